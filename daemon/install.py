"""`dflashd install|uninstall`: launchd agents on macOS, a systemd user unit on Linux.

The templates ship inside the package (the top-level launchd/ folder, installed as dflash.launchd). The plists are filled through
plistlib (parse the template, replace @...@ strings, dump), so a path with odd characters can
never produce an invalid plist. The resolved configuration is written once to
<state>/daemon.json and the agents point at it, so launchd and shells agree on every path.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import plistlib
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from . import paths
from .config import DaemonConfig

LABELS = {"worker": "com.dflash.worker", "cache": "com.dflash.cache"}
UNIT = "dflashd.service"
CONFIG_NAME = "daemon.json"  # the resolved config install writes for the agents
CERT_FILES = ("curve_server_secret", "curve_server_public", "curve_client_secret")


def template(name: str) -> str:
    return resources.files("dflash.launchd").joinpath(name).read_text()


def _fill(value: Any, subs: dict[str, str]) -> Any:
    if isinstance(value, str):
        for key, sub in subs.items():
            value = value.replace(f"@{key}@", sub)
        return value
    if isinstance(value, list):
        return [_fill(v, subs) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, subs) for k, v in value.items()}
    return value


def _pinned(cfg: DaemonConfig) -> DaemonConfig:
    """The config with every path made explicit and absolute, as the agents will run it: they
    start in / (or $HOME), not in the folder `dflashd install` ran in."""
    certs = {k: _absolute(getattr(cfg, k)) for k in CERT_FILES if getattr(cfg, k)}
    cfg = dataclasses.replace(cfg, model=_local(cfg.model), draft=_local(cfg.draft), **certs,
                              runtime_dir=_absolute(cfg.runtime_path()), state_dir=_absolute(cfg.state_path()))
    return dataclasses.replace(cfg, cache_dir=_absolute(cfg.cache_path()),
                               endpoint=_absolute_ipc(cfg.resolved_endpoint()),
                               cache_endpoint=_absolute_ipc(cfg.resolved_cache_endpoint()))


def _absolute(path: str | Path) -> str:
    """Absolute, without resolving symlinks (a `current` link to a model keeps following it)."""
    return os.path.abspath(os.path.expanduser(path))


def _local(model: str | None) -> str | None:
    """A model or draft naming a local path, made absolute; anything else (None, a repo id in
    the Hugging Face cache) as it is."""
    return _absolute(model) if model and Path(model).expanduser().exists() else model


def _absolute_ipc(endpoint: str) -> str:
    sock = paths.ipc_path(endpoint)
    return endpoint if sock is None else f"ipc://{_absolute(sock)}"


def render_plist(agent: str, cfg: DaemonConfig, config_file: Path) -> bytes:
    data = plistlib.loads(template(f"{LABELS[agent]}.plist").encode())
    cache_dir, endpoint, size = cfg.cache_args()[1::2]
    subs = {"LABEL": LABELS[agent], "PYTHON": sys.executable, "CONFIG": f"@{config_file}",
            "LOG_DIR": str(cfg.log_path()), "STATE_DIR": str(cfg.state_path()),
            "CACHE_DIR": cache_dir, "CACHE_ENDPOINT": endpoint, "CACHE_SIZE": size}
    return plistlib.dumps(_fill(data, subs))


def render_unit(cfg: DaemonConfig, config_file: Path) -> str:
    subs = {"PYTHON": sys.executable, "CONFIG_PATH": str(config_file), "LOG_DIR": str(cfg.log_path())}
    return _fill(template(UNIT), subs)


def _agents(cfg: DaemonConfig) -> list[str]:
    # The worker serves L1-only whenever the cache agent is down (or the cache is off).
    return ["worker"] + (["cache"] if cfg.cache and importlib.util.find_spec("dflash.cache.l2") else [])


def _run(cmd: list[str]) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True)
    return f"$ {' '.join(cmd)} -> {out.returncode}" + (f": {out.stderr.strip()}" if out.returncode else "")


def install_agents(cfg: DaemonConfig, dest: Path | None = None, *, load: bool = True,
                   kind: str = "auto") -> list[str]:
    """Write (and unless load=False, bootstrap/enable) the agents; returns lines to print."""
    if not cfg.model:
        raise ValueError("no model configured: the installed worker needs `model`")
    kind = ("launchd" if sys.platform == "darwin" else "systemd") if kind == "auto" else kind
    # A model that fails to load: the unit's supervisor exits 2, which systemd shows as a failure
    # and (RestartPreventExitStatus) does not restart; launchd's KeepAlive would reload it every
    # ThrottleInterval instead, so its worker stays up in "failed" (dflashd status says why).
    cfg = dataclasses.replace(_pinned(cfg), exit_on_load_failure=cfg.exit_on_load_failure or kind == "systemd")
    paths.private_dir(cfg.state_path())
    paths.private_dir(cfg.log_path())
    # --dest DIR: everything install writes goes into DIR (a staged or test install leaves the
    # live <state>/daemon.json, which an installed unit may be running on, alone).
    if dest is not None:  # absolute: the agents start in /, and name daemon.json by this path
        dest = Path(_absolute(dest))
        dest.mkdir(parents=True, exist_ok=True)
    config_file = (dest if dest is not None else cfg.state_path()) / CONFIG_NAME
    _write_private(config_file, cfg.to_json().encode())
    lines = [f"config: {config_file}"]
    if kind == "launchd":
        dest = dest or Path.home() / "Library" / "LaunchAgents"
        dest.mkdir(parents=True, exist_ok=True)
        for agent in _agents(cfg):
            path = dest / f"{LABELS[agent]}.plist"
            _write_private(path, render_plist(agent, cfg, config_file))
            lines.append(f"wrote {path}")
            if load:
                lines.append(_run(["launchctl", "bootout", f"gui/{os.getuid()}", str(path)]))
                lines.append(_run(["launchctl", "bootstrap", f"gui/{os.getuid()}", str(path)]))
    else:
        dest = dest or Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "systemd" / "user"
        dest.mkdir(parents=True, exist_ok=True)
        path = dest / UNIT
        _write_private(path, render_unit(cfg, config_file).encode())
        lines.append(f"wrote {path}")
        if load:
            lines.append(_run(["systemctl", "--user", "daemon-reload"]))
            lines.append(_run(["systemctl", "--user", "enable", "--now", UNIT]))
    return lines


def _write_private(path: Path, data: bytes) -> None:
    """Write `path` mode 0600 (the README: every file the daemon writes is private; launchd and
    systemd read user agents as their owner), tightening a file an older version made 0644."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        os.fchmod(fh.fileno(), 0o600)
        fh.write(data)


def _installed_config(path: Path) -> Path | None:
    """The daemon.json an installed plist or unit runs on (install wrote it), else None: a
    config file of any other name is the user's own and never removed."""
    try:
        if path.suffix == ".plist":
            args = plistlib.loads(path.read_bytes()).get("ProgramArguments", [])
        else:
            line = next((ln for ln in path.read_text().splitlines() if ln.startswith("ExecStart=")), "")
            _, flag, value = line.partition(" --config-json ")
            args = ["--config-json", value] if flag else []
    except (OSError, ValueError, plistlib.InvalidFileException):
        return None
    for flag, value in zip(args, args[1:]):
        if flag == "--config-json" and isinstance(value, str) and value.startswith("@"):
            config = Path(value[1:])
            return config if config.name == CONFIG_NAME else None
    return None


def uninstall_agents(dest: Path | None = None, *, unload: bool = True, kind: str = "auto") -> list[str]:
    """Remove the agents and the daemon.json install wrote for them (found in the agents
    themselves, so a --dest install and a custom state dir are both undone)."""
    kind = ("launchd" if sys.platform == "darwin" else "systemd") if kind == "auto" else kind
    lines = []
    configs: list[Path] = []
    if kind == "launchd":
        dest = dest or Path.home() / "Library" / "LaunchAgents"
        for label in LABELS.values():
            path = dest / f"{label}.plist"
            if path.exists():
                if unload:
                    lines.append(_run(["launchctl", "bootout", f"gui/{os.getuid()}", str(path)]))
                configs.append(_installed_config(path))
                path.unlink()
                lines.append(f"removed {path}")
    else:
        dest = dest or Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config") / "systemd" / "user"
        path = dest / UNIT
        if path.exists():
            if unload:
                lines.append(_run(["systemctl", "--user", "disable", "--now", UNIT]))
            configs.append(_installed_config(path))
            path.unlink()
            lines.append(f"removed {path}")
    for config in dict.fromkeys(c for c in configs if c is not None):
        if config.exists():
            config.unlink()
            lines.append(f"removed {config}")
    return lines or ["nothing installed"]
