"""Make MLX fast on the machine the worker finds, before MLX is imported.

On x86-64 Linux MLX's CPU backend takes cblas_sgemm from whatever BLAS libmlx.so resolves
through its RPATH; preloading Intel MKL (the `mkl` PyPI package, extra `dflash[fastcpu]`) makes
fp32 matmuls ~30x faster. LD_PRELOAD only works at exec time, so the worker re-executes itself
once with it set. The choice is recorded in DFLASH_ACCEL and reported by `dflashd status`. The `dflash`
commands (generate, benchmark, train-draft) and the worker all go through here.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

MARK = "DFLASH_ACCEL"  # set in the re-executed worker: what was chosen (also stops a loop)


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
    return {
        "LD_PRELOAD": preload,
        "MKL_THREADING_LAYER": "SEQUENTIAL",
        MARK: f"mkl ({mkl})",
    }


def maybe_reexec(blas: str | None = None, module: str | None = None) -> None:
    """Re-exec this program with the planned environment (no return when it does).

    `module`: run as `python -m module argv...` (the worker); default: the same command again
    (a console script, or the `-m` module this process was started as). `blas` defaults to
    $DFLASH_BLAS or "auto".
    """
    blas = blas or os.environ.get("DFLASH_BLAS", "auto")
    extra = plan(blas)
    if extra is None:
        os.environ.setdefault(MARK, "default BLAS (blas = none)" if blas == "none" else _describe())
        return
    if module is None:
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        head = ["-m", spec.name] if spec is not None and spec.name else [sys.argv[0]]
    else:
        head = ["-m", module]
    env = dict(os.environ, **extra)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *head, *sys.argv[1:]], env)


def _describe() -> str:
    if sys.platform == "darwin":
        return "metal (Apple silicon)" if platform.machine() == "arm64" else "macOS CPU"
    return f"default BLAS ({platform.machine()}; mkl not installed: pip install 'dflash[fastcpu]')"


def describe() -> str:
    """What the running worker chose (after maybe_reexec)."""
    return os.environ.get(MARK) or _describe()
