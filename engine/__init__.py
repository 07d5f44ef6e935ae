"""dflash.engine: DFlash block-diffusion speculative decoding on mlx-lm targets.

The public API: `load_pair` to load a target and its draft, `stream_dflash_generate` to
generate (greedy, lossless), and the event types it yields.
"""

from .generate import Finished, GenerationStats, TokenDelta, stream_dflash_generate
from .loading import Pair, load_pair

__all__ = [
    "Finished",
    "GenerationStats",
    "Pair",
    "TokenDelta",
    "load_pair",
    "stream_dflash_generate",
]
