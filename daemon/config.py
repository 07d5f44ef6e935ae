"""dflashd configuration: defaults < config file (TOML) < DFLASH_* environment < command-line flags.

One dataclass holds every setting; `load_config` applies the four layers in that order. The file
is `--config PATH`, else $DFLASH_CONFIG, else ~/.config/dflash/config.toml (if present): top-level
keys or a [daemon] table, plus a [generation] table for the sampling defaults (temperature, top_p,
top_k, seed, min_p, min_tokens_to_keep, and the penalties of docs/sampling.md) used when a request leaves them unset. Each field `name` can be set by the env var
DFLASH_<NAME> (e.g. DFLASH_MAX_QUEUE=128, DFLASH_TEMPERATURE=0.7).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from . import paths
from .protocol import PENALTY_FIELDS, SAMPLING_FIELDS, shown

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A setting the loaded pair cannot take (found only once it is loaded, e.g. a verify window
    wider than the draft's block): the worker reports it as its load error, and `dflashd start`
    stops the daemon and exits 2 as for any other bad setting."""


# What the daemon refuses past (each >= 1); `stats.limits` reports them so clients can fit requests.
LIMIT_FIELDS = ("max_queue", "max_tokens_limit", "max_prompt_tokens", "max_frame_bytes", "max_attempts")


@dataclass
class DaemonConfig:
    # model pair
    model: str | None = None
    draft: str | None = None
    dtype: str | None = None
    kv_bits: int | None = None
    # endpoints and directories ("" = derived from runtime_dir)
    endpoint: str = ""
    cache_endpoint: str = ""
    runtime_dir: str = ""
    state_dir: str = ""
    # CURVE (required for tcp:// on a non-loopback address): zmq.auth certificate files
    curve_server_secret: str = ""  # the worker's secret cert
    curve_server_public: str = ""  # the worker's public cert (clients)
    curve_client_secret: str = ""  # a client's secret cert (clients; generated if empty)
    # queue
    max_queue: int = 64
    max_tokens_limit: int = 8192
    max_prompt_tokens: int = 32768
    max_frame_bytes: int = 1 << 20
    job_timeout_s: float = 600.0
    max_attempts: int = 3
    result_retention_s: float = 3600.0
    heartbeat_s: float = 0.4
    # tiered prefix cache: L1 in the worker's RAM, L2 in the cache process (diskcache)
    l1_cache_gb: float = 2.0
    l2_cache_gb: float = 20.0
    cache: bool = True  # false: no prefix cache and no cache process
    l1_cache_entries: int = 64
    cache_dir: str = ""  # L2 store ("" = <state_dir>/cache)
    cache_every: int = 256  # snapshot interval (tokens) during prefill; doubles past 8 intervals (cache/tiers.py)
    # generation defaults for requests that leave them unset ([generation] in the TOML file)
    temperature: float = 0.0  # 0 = greedy (the engine's lossless mode)
    top_p: float = 1.0  # 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # None: each sampled job draws a random seed
    min_p: float = 0.0  # 0 = off
    min_tokens_to_keep: int = 1  # the tokens min-p always keeps (mlx-lm's default 1)
    repetition_penalty: float = 1.0  # 1 = off (mlx-lm's logits processors)
    repetition_context_size: int = 20
    presence_penalty: float = 0.0  # 0 = off
    presence_context_size: int = 20
    frequency_penalty: float = 0.0  # 0 = off
    frequency_context_size: int = 20
    # tokens per verify: auto (follows measured timings), full, or 1..block size; never changes
    # greedy output, but a seed repeats its sampled ids only under a fixed window
    verify_window: str = "auto"
    # platform
    blas: str = "auto"  # auto | mkl | none
    restart_backoff_s: float = 0.5
    restart_backoff_max_s: float = 30.0
    # a model that fails to load makes the worker exit 2 (and the supervisor stop) instead of
    # staying up in the "failed" state: what a service manager needs to see the failure
    exit_on_load_failure: bool = False
    # run the engine's paths once after the load, before the first job (daemon/compute.py):
    # a fresh MLX-CUDA process compiles its kernels at their first call, which the first request
    # paid (an H100, session 37: 31 tok/s against 213-560 for the requests after it)
    warm_up: bool = True

    def window(self) -> str | int:
        """The verify window as a job carries it: "auto", "full" or a token count."""
        from .protocol import window_from_text

        return window_from_text(str(self.verify_window))

    def resolved_endpoint(self) -> str:
        return self.endpoint or f"ipc://{self.runtime_path() / 'worker.sock'}"

    def resolved_cache_endpoint(self) -> str:
        return self.cache_endpoint or f"ipc://{self.runtime_path() / 'cache.sock'}"

    def cache_path(self) -> Path:
        return Path(self.cache_dir) if self.cache_dir else self.state_path() / "cache"

    def cache_args(self) -> list[str]:
        """Arguments of `python -m dflash.cache.l2` for this configuration."""
        return ["--dir", str(self.cache_path()), "--endpoint", self.resolved_cache_endpoint(),
                "--size-limit", str(int(self.l2_cache_gb * (1 << 30)))]

    def runtime_path(self) -> Path:
        return Path(self.runtime_dir) if self.runtime_dir else paths.default_runtime_dir()

    def state_path(self) -> Path:
        return Path(self.state_dir) if self.state_dir else paths.default_state_dir()

    def log_path(self) -> Path:
        return self.state_path() / "logs"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "DaemonConfig":
        """From a JSON string, or from a JSON file when `text` is "@PATH" (installed agents)."""
        if text.startswith("@"):
            text = Path(text[1:]).read_text()
        return _apply(cls(), json.loads(text), "resolved config")

    def validate(self) -> None:
        """Refuse settings that would be unsafe or meaningless; raises ValueError."""
        ep = self.resolved_endpoint()
        if ep.startswith("tcp://"):
            host = ep[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
            if not is_loopback(host) and not self.curve_server_secret:
                raise ValueError(f"{shown(ep)} is not a loopback address: set curve_server_secret (CURVE keys)")
        elif not ep.startswith("ipc://"):
            raise ValueError(f"endpoint must be ipc:// or tcp://, got {shown(ep)}")
        cep = self.resolved_cache_endpoint()
        if cep.startswith("tcp://"):
            if not is_loopback(cep[len("tcp://") :].rsplit(":", 1)[0].strip("[]")):
                raise ValueError(f"cache_endpoint {shown(cep)} must be ipc:// or a loopback tcp:// address")
        elif not cep.startswith("ipc://"):
            raise ValueError(f"cache_endpoint must be ipc:// or tcp://, got {shown(cep)}")
        if cep == ep:
            raise ValueError(f"cache_endpoint and endpoint are both {shown(ep)}: the worker and the cache process "
                             "each need their own")
        for name, low, strict in (("cache_every", 1, False), ("l1_cache_entries", 0, False),
                                  ("l1_cache_gb", 0, False), ("l2_cache_gb", 0, True)):
            value = getattr(self, name)
            if value < low or (strict and value == low):
                raise ValueError(f"{name} must be {'>' if strict else '>='} {low}, got {value}")
        from dflash.engine.rollback import kv_bits_problem

        if (problem := kv_bits_problem(self.kv_bits)) is not None:
            raise ValueError(problem)
        if self.blas not in ("auto", "mkl", "none"):
            raise ValueError(f"blas must be auto, mkl or none, got {shown(self.blas)}")
        for name in LIMIT_FIELDS:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        from .protocol import processors_problem, sampling_problem, verify_window_problem

        if verify_window_problem(self.window()) is not None:
            raise ValueError("verify_window must be auto, full or a number of tokens >= 1, "
                             f"got {shown(self.verify_window)}")

        problem = (sampling_problem(self.temperature, self.top_p, self.top_k, self.seed, self.min_p,
                                    self.min_tokens_to_keep)
                   or processors_problem({k: getattr(self, k) for k in PENALTY_FIELDS}))
        if problem is not None:
            raise ValueError(f"[generation] {problem[1]}")


def is_loopback(host: str) -> bool:
    """True for localhost and loopback addresses (binding elsewhere needs keys)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_FIELDS = {f.name: f for f in dataclasses.fields(DaemonConfig)}
GENERATION_KEYS = SAMPLING_FIELDS + PENALTY_FIELDS  # the [generation] table: a submit's sampling defaults


def _coerce(name: str, value: Any, source: str) -> Any:
    """A value of the field's type from TOML/JSON values or env strings."""
    default = _FIELDS[name].default
    kind = type(default) if default is not None else (int if name in ("kv_bits", "seed") else str)
    if value is None or (isinstance(value, str) and value == "" and default is None):
        return None
    try:
        if kind is bool:
            return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes", "on")
        if kind in (int, float) and not isinstance(value, bool):
            return kind(value)
        if kind is str:
            return str(value)
    except (TypeError, ValueError):
        pass
    raise ValueError(f"{source}: {name} must be {kind.__name__}, got {shown(value)}")


def _apply(cfg: DaemonConfig, values: Mapping[str, Any], source: str) -> DaemonConfig:
    unknown = sorted(k for k in values if k not in _FIELDS)
    if unknown:
        raise ValueError(f"{source}: unknown setting(s) {', '.join(unknown)}")
    return dataclasses.replace(cfg, **{k: _coerce(k, v, source) for k, v in values.items()})


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> DaemonConfig:
    """Defaults, then the TOML file, then DFLASH_* env vars, then `overrides` (flags; None skipped)."""
    env = os.environ if env is None else env
    cfg = DaemonConfig()
    file = Path(path) if path else Path(env["DFLASH_CONFIG"]) if env.get("DFLASH_CONFIG") else None
    if file is None and paths.default_config_file().is_file():
        file = paths.default_config_file()
    if file is not None:
        with open(file, "rb") as fh:
            data = tomllib.load(fh)
        if "daemon" in data:  # what sits beside a [daemon] table was dropped without a word (a typo'd table too)
            if not isinstance(data["daemon"], dict):
                raise ValueError(f"{file}: daemon must be a table ([daemon]), got {shown(data['daemon'])}")
            stray = sorted(k for k in data if k not in ("daemon", "generation"))
            if stray:
                raise ValueError(f"{file}: with a [daemon] table, only [generation] may stand beside it; got "
                                 f"{', '.join(stray)} (put settings in [daemon], or use no [daemon] table)")
        section = dict(data.get("daemon", data))
        generation = data.get("generation", {})
        section.pop("generation", None)
        bad = sorted(set(generation) - set(GENERATION_KEYS)) if isinstance(generation, dict) else generation
        if bad:
            raise ValueError(f"{file}: [generation] takes only {', '.join(GENERATION_KEYS)}; got {shown(bad)}")
        cfg = _apply(cfg, {**section, **generation}, str(file))
    from_env = {n: env[f"DFLASH_{n.upper()}"] for n in _FIELDS if f"DFLASH_{n.upper()}" in env}
    cfg = _apply(cfg, from_env, "environment")
    cfg = _apply(cfg, {k: v for k, v in (overrides or {}).items() if v is not None}, "flags")
    return cfg
