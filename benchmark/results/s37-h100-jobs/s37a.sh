# Session 37, call A: the goal's chat command (each question re-run: revisited lengths) with the
# new verify_revisited_ms, then the same with cuDNN attention on (the control: a per-shape cache
# the revisited timing must show)
. .devq/common.sh
bash scripts/h200_pair.sh ptxrestore
B=/tmp/stage/files/bundled
bench chat-s37-h200 8 $B 280 --chat
MLX_CUDA_USE_CUDNN_SDPA=1 bench chat-s37-h200-cudnn-on 8 $B 200 --chat --repeats 1
