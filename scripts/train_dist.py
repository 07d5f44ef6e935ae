#!/usr/bin/env python3
"""`dflash train-draft` for one rank of a data-parallel run; start it with MLX's launcher:

    python3 -m mlx.launch --backend nccl -n 2 scripts/train_dist.py --target T --out O [flags]

Every rank runs this same command (mlx.launch sets the rank/size environment, and with the
NCCL backend each rank sees its own GPU as gpu 0). The flags are exactly `dflash train-draft`'s;
rank 0 logs, writes the checkpoint and the draft, and evaluates. Without a launcher it is a plain
single-process run. `dflash.engine` is imported from this repository when it is not installed.
"""

import os
import sys
import tempfile


def _importable() -> None:
    try:
        import dflash.engine  # noqa: F401
    except ImportError:
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        shim = tempfile.mkdtemp(prefix="dflash-shim-")
        os.makedirs(os.path.join(shim, "dflash"))
        open(os.path.join(shim, "dflash", "__init__.py"), "w").close()
        os.symlink(os.path.join(repo, "engine"), os.path.join(shim, "dflash", "engine"))
        sys.path.insert(0, shim)


if __name__ == "__main__":
    _importable()
    from dflash.engine.training.loop import train_draft_command

    train_draft_command.main(args=sys.argv[1:], prog_name="train_dist.py")
