"""Training DFlash drafts (`dflash train-draft`): data, objective, schedule, checkpoints, the loop.

    data.py        prompts, target-regenerated responses (batched greedy), fixed-shape batches
    objective.py   the target pass, block_hidden (all blocks in one masked pass), block_loss
    schedule.py    lr as a pure function of the campaign's global step
    checkpoint.py  bf16 weights in <= 15 MB parts + trainer.json; resume / init
    memory.py      one step's memory from its shapes, refused up front when it cannot fit
    report.py      held-out evaluation with the real decoding loop; the model card
    loop.py        options, the (data-parallel) loop, the CLI
"""

from .loop import TrainOptions, draft_config_for, pick_mask_token, train_draft
from .objective import block_hidden, block_loss, default_gamma
from .report import evaluate

__all__ = ["TrainOptions", "block_hidden", "block_loss", "default_gamma", "draft_config_for",
           "evaluate", "pick_mask_token", "train_draft"]
