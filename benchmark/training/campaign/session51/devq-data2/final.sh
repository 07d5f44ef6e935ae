# Session 51's final phase (written by session 50): session 44's final.sh, i.e. soup50 (the new
# draft averaged with soup41) and the new draft on the GPU's held-out set (bf16, 256 tokens, one
# row; EVAL_START=0: soup41 read 3.47 on an H100). The generation-fault probe it once ran after
# them is answered (session50/README.md): none here.
bash benchmark/training/campaign/session44/devq/final.sh
