"""Make MLX fast on the machine the worker finds, before MLX is imported.

On x86-64 Linux MLX's CPU backend takes cblas_sgemm from whatever BLAS libmlx.so resolves
through its RPATH; preloading Intel MKL (the `mkl` PyPI package, extra `dflash[fastcpu]`) makes
fp32 matmuls ~30x faster. LD_PRELOAD only works at exec time, so the worker re-executes itself
once with it set. The choice is recorded in DFLASH_ACCEL and reported by `dflashd status`. The `dflash`
commands (generate, benchmark, train-draft) and the worker all go through here.

On MLX's CUDA backend (0.32) scaled_dot_product_attention goes through cuDNN, which builds one
graph per exact shape: a multi-token forward at a KV length not seen before costs ~5x (a 16-token
verify of an 8B model: 77.8 ms at a new length vs 12.7 ms with cuDNN SDPA off), and a speculative
decoder verifies at a new length every cycle. `MLX_CUDA_USE_CUDNN_SDPA=0` turns that path off;
MLX reads it once, on its first GPU attention call.

MLX-CUDA also records kernels into CUDA graphs (up to 100 a graph on an H100/H200), updated or
instantiated anew at every commit. A draft cycle commits its small graphs one after another
(the draft, then the verify layer group by layer group) and reads one result, so the host pays
that bookkeeping on every cycle. `MLX_USE_CUDA_GRAPHS=0` launches the kernels straight onto the
stream instead. Measured on the H200 (session 22, bf16 SmolLM2-135M and the bundled draft,
8 prompts decoded on mlx-lm's own texts, one process per setting, two interleaved rounds): with
graphs DFlash's "auto" window ran 262 / 280 tok/s and the whole block 282 / 301, without them
374 / 361 and 394 / 404, while mlx-lm's plain decoding in the same processes ran 166 / 160 and
178 / 182 (not slower without). MLX reads this switch once as well, at its first commit.

`use_cuda_env()` sets both (each unless the user set it: an explicit value always wins) when
`dflash.engine` is imported, i.e. before any model runs, and the re-executed process inherits
them; `describe()` and `setting()` report them.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
import warnings
from pathlib import Path

MARK = "DFLASH_ACCEL"  # set in the re-executed worker: what was chosen (also stops a loop)
CUDNN_SDPA = "MLX_CUDA_USE_CUDNN_SDPA"  # MLX's switch: 0 = no cuDNN attention (per-shape graphs)
SDPA_SOURCE = "DFLASH_CUDNN_SDPA_SET_BY"  # "dflash" when dflash set CUDNN_SDPA (absent: the user)
CUDA_GRAPHS = "MLX_USE_CUDA_GRAPHS"  # MLX's switch: 0 = kernels launched directly, no CUDA graphs
GRAPHS_SOURCE = "DFLASH_CUDA_GRAPHS_SET_BY"  # "dflash" when dflash set CUDA_GRAPHS
# MLX-CUDA switch -> (dflash's value, the variable recording that dflash set it)
CUDA_SETTINGS = {CUDNN_SDPA: ("0", SDPA_SOURCE), CUDA_GRAPHS: ("0", GRAPHS_SOURCE)}


def env_switch(name: str, default: bool) -> bool:
    """An on/off setting of the engine from the environment (1 or 0; unset or empty: `default`);
    any other value is refused with the variable's name."""
    env = os.environ.get(name, "").strip()
    if env:
        if env not in ("0", "1"):
            raise ValueError(f"{name} must be 0 or 1, got {env!r}")
        return env == "1"
    return default


def cuda_env(env: dict | None = None) -> dict[str, str]:
    """Env additions that keep MLX-CUDA off cuDNN attention and off CUDA graphs, each only
    where the user has not chosen a value.

    Harmless where there is no CUDA (MLX ignores the variables); skipped on macOS (Metal only).
    """
    env = os.environ if env is None else env
    if sys.platform == "darwin":
        return {}
    extra = {}
    for name, (value, source) in CUDA_SETTINGS.items():
        if name not in env:
            extra.update({name: value, source: "dflash"})
    return extra


def use_cuda_env(env: dict | None = None) -> bool:
    """Apply cuda_env() to `env` (default: this process, inherited by children); True if set now."""
    env = os.environ if env is None else env
    extra = cuda_env(env)
    env.update(extra)
    return bool(extra)


def setting(name: str, env: dict | None = None) -> dict[str, str | None]:
    """{"value": the MLX-CUDA switch's value or None (MLX's default: on), "set_by": dflash|user|None}."""
    env = os.environ if env is None else env
    value = env.get(name)
    if value is None:
        return {"value": None, "set_by": None}
    return {"value": value, "set_by": env.get(CUDA_SETTINGS[name][1]) or "user"}



def find_mkl(prefix: str | Path | None = None) -> Path | None:
    """The real path of libmkl_rt.so.{2,3} inside the environment's lib dir, if installed."""
    lib = Path(prefix or sys.prefix) / "lib"
    for name in ("libmkl_rt.so.2", "libmkl_rt.so.3"):
        candidate = lib / name
        if candidate.exists():
            return candidate.resolve()
    found = sorted(lib.glob("libmkl_rt.so.*")) if lib.is_dir() else []
    return found[0].resolve() if found else None


def plan(blas: str = "auto", prefix: str | Path | None = None, env: dict | None = None) -> dict[str, str] | None:
    """Env additions for a re-exec with MKL preloaded, or None when nothing is to be done."""
    env = os.environ if env is None else env
    if blas == "none" or MARK in env:
        return None
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    mkl = find_mkl(prefix)
    if mkl is None:
        if blas == "mkl":
            raise RuntimeError("blas = mkl but libmkl_rt.so.* is not in this environment (pip install mkl)")
        return None
    preload = " ".join(p for p in (str(mkl), env.get("LD_PRELOAD", "")) if p)
    layer = threading_layer(mkl.parent, env)
    return {
        "LD_PRELOAD": preload,
        "MKL_THREADING_LAYER": layer,
        MARK: f"mkl ({mkl}, {layer.lower()} threading)",
    }


def threading_layer(lib: Path, env: dict, vendor: str | None = None) -> str:
    """MKL's threading layer: the user's MKL_THREADING_LAYER when set; else SEQUENTIAL (one
    core) on AMD CPUs; else INTEL (OpenMP over every core) when the `mkl` package brought its
    OpenMP runtime (libiomp5, from `intel-openmp`) beside it, else SEQUENTIAL.

    Measured in session 12 on the 2-core Xeon VM (SmolLM2-135M fp32, the bundled draft):
    mlx-lm's plain decoding 16.8 -> 18.7 tok/s (means of 3 interleaved pairs of 2 runs); in
    `dflash benchmark --chat` a decode step 64-79 -> 41-57 ms, a 16-token verify 157-168 ->
    100-129 ms and a draft pass 43-54 -> 28-42 ms (wide products gain most from a second core),
    so the chat speedup went from 1.30x / 1.31x / 1.30x to 1.46x / 1.53x / 1.44x (geometric means
    of three interleaved runs each).
    On the 2-core AMD EPYC VMs (session 35) one thread is faster end to end. The chat benchmark,
    two interleaved pairs: SEQUENTIAL 1.84x / 1.84x against INTEL 1.72x / 1.67x (the four
    questions short of near-certain acceptance 1.34-1.61x against 1.12-1.50x, mlx-lm 20-23 tok/s
    either way); in the daemon (6 jobs each, `--compare-plain`) plain decoding 19.9-20.8 ->
    23.1-24.2 tok/s and DFlash 23.8-28.6 -> 25.2-30.3. Only wide products still gain from the
    threads (the benchmark's 16-token verify 88-112 ms threaded against 114-121 ms; the
    near-certain question 5.63-5.66x against 4.85-4.97x), while a CPU drafts mostly with narrow
    windows.
    MKL runs its generic kernels there (libmkl_def), and a third of the worker's samples sat in
    OpenMP's spin-wait (kmp_flag_64::wait) beside the worker's own threads.
    """
    if env.get("MKL_THREADING_LAYER"):
        return env["MKL_THREADING_LAYER"]
    if (cpuinfo("vendor_id") if vendor is None else vendor) == "AuthenticAMD":
        return "SEQUENTIAL"
    return "INTEL" if any(lib.glob("libiomp5.so*")) else "SEQUENTIAL"


def cpuinfo(field: str) -> str:
    """A field of /proc/cpuinfo's first processor ("vendor_id": "GenuineIntel", "AuthenticAMD";
    "model name"), "" where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def maybe_reexec(blas: str | None = None, module: str | None = None) -> None:
    """Re-exec this program with the planned environment (no return when it does).

    `module`: run as `python -m module argv...` (the worker); default: the same command again
    (a console script, or the `-m` module this process was started as). `blas` defaults to
    $DFLASH_BLAS or "auto".
    """
    use_cuda_env()  # normally done already by `import dflash.engine`; the child inherits it
    blas = blas or os.environ.get("DFLASH_BLAS", "auto")
    extra = plan(blas)
    if extra is None:
        # kept in this process only: as an environment variable it would reach child processes
        # (a daemon started from here) and stop their own choice (MARK stops a re-exec loop)
        global _CHOSEN
        _CHOSEN = "default BLAS (blas = none)" if blas == "none" else None
        return
    if module is None:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        head = ["-m", spec.name] if spec is not None and spec.name else [sys.argv[0]]
    else:
        head = ["-m", module]
    env = dict(os.environ, **extra)
    for stream in (sys.stdout, sys.stderr):  # None when started with it closed (`>&-`)
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: its text is lost either way
                pass
    os.execve(sys.executable, [sys.executable, *head, *sys.argv[1:]], env)


_CHOSEN: str | None = None  # maybe_reexec's choice when it did not re-execute (None: _describe())


class SlowBLASWarning(RuntimeWarning):
    """fp32 on the CPU through MLX's reference BLAS while MKL is installed but not loaded (a
    library user's process, which the commands' re-exec cannot reach); filterable by category."""


# Below this many parameters a forward is dispatch-bound, not BLAS-bound (the tests' random
# 4-layer models), and the warning's "several times slower" would not hold.
SLOW_BLAS_MIN_PARAMS = 10_000_000
_WARNED = False


def mkl_loaded(maps: str | Path = "/proc/self/maps") -> bool | None:
    """Whether libmkl_rt is mapped into this process; None where that cannot be read (not Linux)."""
    try:
        with open(maps, "rb") as f:
            return b"libmkl_rt" in f.read()
    except OSError:
        return None


def fix_prefix(prefix: str | Path | None = None, env: dict | None = None) -> str | None:
    """The `LD_PRELOAD=... MKL_THREADING_LAYER=...` command prefix the commands' re-exec would
    use here (plan()), or None where it would not preload anything."""
    extra = plan("auto", prefix, {k: v for k, v in (os.environ if env is None else env).items() if k != MARK})
    if extra is None:
        return None
    return f"LD_PRELOAD={extra['LD_PRELOAD']} MKL_THREADING_LAYER={extra['MKL_THREADING_LAYER']}"


def warn_slow_blas(dtype: str | None, params: int, on_cpu: bool, stacklevel: int = 3) -> bool:
    """Warn once per process (SlowBLASWarning) when a model of `params` parameters will run fp32
    on the CPU with MKL installed but not loaded: the commands and the daemon's worker re-exec
    themselves with it preloaded, a library user's process cannot be, and without a word it
    decodes several times slower (SmolLM2-135M: 3.8 against 22.8 tok/s). Nothing with
    DFLASH_BLAS=none (or a worker's blas = none), on a GPU, outside Linux; True if it warned."""
    global _WARNED
    if _WARNED or not on_cpu or dtype != "float32" or params < SLOW_BLAS_MIN_PARAMS:
        return False
    if os.environ.get("DFLASH_BLAS", "auto") == "none" or _CHOSEN is not None:
        return False
    if sys.platform != "linux" or mkl_loaded() is not False:
        return False
    prefix = fix_prefix()
    if prefix is None:  # no MKL in this environment (or not x86-64): nothing to point at
        return False
    _WARNED = True
    warnings.warn(
        "MKL is installed but not loaded into this process: fp32 on the CPU runs MLX's reference "
        "BLAS, several times slower (SmolLM2-135M: ~4 against ~23 tok/s). LD_PRELOAD works only "
        f"at exec time: run your program as `{prefix} python ...`, or call "
        "`dflash.engine.accel.maybe_reexec()` first thing in your script (it re-executes it so); "
        "DFLASH_BLAS=none silences this", SlowBLASWarning, stacklevel=stacklevel)
    return True


def _describe() -> str:
    if sys.platform == "darwin":
        return "metal (Apple silicon)" if platform.machine() == "arm64" else "macOS CPU"
    return linux_text(*_gpu())


@functools.lru_cache(maxsize=1)
def _gpu() -> tuple[bool, str]:
    """Whether MLX runs on a GPU here (its CUDA backend), and the GPU's name: asked once a
    process (describe() also names the prefix cache's keys), after any re-exec, so importing
    MLX here is harmless."""
    import mlx.core as mx

    if mx.default_device().type != mx.gpu:
        return False, ""
    try:
        return True, str(mx.device_info().get("device_name", ""))
    except (AttributeError, RuntimeError):
        return True, ""


def linux_text(on_gpu: bool, gpu_name: str) -> str:
    """Without MKL preloaded: on a CUDA GPU the model runs there and the CPU's BLAS is beside
    the point, so no advice to install MKL (a GPU daemon's status said so until session 38)."""
    if on_gpu:
        return f"MLX-CUDA on {gpu_name or 'a GPU'}"
    return f"default BLAS ({platform.machine()}; mkl not installed: pip install 'dflash[fastcpu]')"


def describe() -> str:
    """What the running worker chose (after maybe_reexec): the BLAS, and the MLX-CUDA switches set."""
    text = os.environ.get(MARK) or _CHOSEN or _describe()
    for name in CUDA_SETTINGS:
        s = setting(name)
        if s["value"] is not None:
            text += f"; {name}={s['value']} (set by {s['set_by']})"
    return text
