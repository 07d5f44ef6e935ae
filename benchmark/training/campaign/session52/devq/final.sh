# Session 52's final phase (written by session 51): session 44's final.sh, i.e. soup52 (the new
# draft averaged with its start, session51/draft) and the new draft on the GPU's held-out set
# (bf16, 256 tokens, one row; EVAL_START=0: the start read 3.42 on session 51's H100).
bash benchmark/training/campaign/session44/devq/final.sh
