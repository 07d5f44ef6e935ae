"""Where the numbers came from: the machine (CPU, memory, MLX device, GPU) and the versions.

Why a module of its own: written into every benchmark JSON, and into the JSON of the scripts
that measure beside it (arms_ab, cycle_profile, cycle_parts, text_check), so results of any of
them say which machine and which mlx / mlx-lm / dflash they came from.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

from .. import accel


def hardware_info() -> dict:
    """Where the numbers came from: CPU, memory, MLX device, and the GPU's name on CUDA."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or accel.cpuinfo("model name"),
        "cpu_count": os.cpu_count(),
        "memory_gb": _memory_gb(),
        "mx_default_device": str(mx.default_device()),
    }
    try:
        info["mx_device_info"] = {k: v for k, v in mx.device_info().items()
                                  if isinstance(v, (str, int, float))}
    except Exception:  # noqa: BLE001 - informational only
        pass
    gpu = _nvidia_gpu()
    if gpu:
        info["gpu"] = gpu
    blas = {k: os.environ[k] for k in ("LD_PRELOAD", "MKL_THREADING_LAYER", *accel.CUDA_SETTINGS)
            if k in os.environ}
    if blas:
        info["env"] = blas
    return info


def _memory_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _nvidia_gpu() -> str | None:
    if mx.default_device() != mx.gpu or sys.platform == "darwin":
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def v(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"mlx": mx.__version__, "mlx_lm": v("mlx-lm"), "dflash": v("dflash"),
            "python": platform.python_version()}
