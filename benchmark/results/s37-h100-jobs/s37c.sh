# Session 37, call C (the control): dflash's verify through MLX's attention (DFLASH_VERIFY_ATTN=mlx)
# with cuDNN attention on and off, one repeat each: a per-shape cache the revisited timing must show
source .device/7/activate.sh && . .devq/common.sh >/dev/null 2>&1 && B=/tmp/stage/files/bundled
DFLASH_VERIFY_ATTN=mlx MLX_CUDA_USE_CUDNN_SDPA=1 bench chat-s37-h200-mlxattn-cudnn-on 8 $B 150 --chat --repeats 1
DFLASH_VERIFY_ATTN=mlx bench chat-s37-h200-mlxattn-cudnn-off 8 $B 150 --chat --repeats 1
