"""dflash.engine: DFlash block-diffusion speculative decoding on mlx-lm targets.

The public API: `load_pair` to load a target and its draft, `stream_dflash_generate` to
generate (greedy, or sampling with temperature/top_p/top_k/seed; lossless either way), the
event types it yields, and `SamplingParams` (checks sampling options up front).

Importing it sets MLX_CUDA_USE_CUDNN_SDPA=0 and MLX_USE_CUDA_GRAPHS=0, each unless the
environment already has a value (see accel.py: MLX-CUDA's cuDNN attention builds a graph per
shape, ~5x per new KV length; CUDA graphs cost a draft cycle more host time than they save). MLX
reads each once, at its first GPU attention call or commit: import dflash.engine before running
any model, or export the variables yourself.
"""

import importlib
from typing import Any

from .accel import use_cuda_env

use_cuda_env()  # before anything imports mlx; a user's explicit value wins

# The API, imported on first use (PEP 562): importing the package stays light (no MLX, no
# mlx-lm), so the `dflash` command can start under its Ctrl-C guard (launch.py).
_API = {"Finished": ".generate", "GenerationStats": ".generate", "TokenDelta": ".generate",
        "stream_dflash_generate": ".generate", "Pair": ".loading", "load_pair": ".loading",
        "SamplingParams": ".sampling"}


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Finished",
    "GenerationStats",
    "Pair",
    "SamplingParams",
    "TokenDelta",
    "load_pair",
    "stream_dflash_generate",
]
