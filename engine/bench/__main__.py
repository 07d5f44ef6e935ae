"""`python -m dflash.engine.bench ...`: `dflash benchmark` without the full CLI.

Why a module of its own: the package's entry point for `python -m` (e.g. on a machine where only
PYTHONPATH is set up); before session 33 this was the `__main__` block of the benchmark module.
"""

from .. import accel
from .cli import benchmark_command

if __name__ == "__main__":
    accel.maybe_reexec()  # MKL preload on CPU, like `dflash benchmark` (cuDNN SDPA: set on import)
    benchmark_command()
