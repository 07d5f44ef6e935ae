"""Few-query attention on CUDA: one fused kernel for a verify's 4..16 queries over the whole cache.

Why: MLX 0.32's CUDA backend has a fused kernel for fewer than 4 queries (decode) and cuDNN for
more; with cuDNN off (it builds a graph per shape, see accel.py) a 16-token verify falls back to
unfused matmul + mask + softmax + matmul, several launches a layer, and the scores go through
memory. Whole verifies of the Qwen3-8B shape on one H200 (bf16, first-time lengths, session 8,
docs/benchmark.md): 23.4 ms with MLX's attention against 16.3 ms with this kernel at 8K keys
(a decode step: 10.5 ms), 19.3 against 18.8 ms at 1K.

How (flash-decoding, two launches): the keys are split into chunks; one block per (chunk, KV head,
batch) loads its chunk's keys and values once, 64 at a time, and scores them against every query
row that shares the KV head (G query heads x M positions, padded to whole 16-row tiles) on the
tensor cores (16x16x16 WMMA tiles, bf16/fp16 in, fp32 sums), keeping a running max, sum and
weighted-value sum per row (online softmax in fp32; the probabilities enter the second product in
the input dtype, as flash attention does). The second launch combines the chunks' partial sums
per row and writes the output position-major ([B, M, Hq, D] in memory, handed back as a
[B, Hq, M, D] view): every caller transposes it back to [B, M, Hq * D] for its output
projection, which is then a view instead of one more copy kernel a layer. K and V are read
through their strides (16-byte loads when aligned), so the cache's slice views are not copied.
Causal: query i of M sits at position N - M + i and sees keys up to it. Non-causal (a draft
block over its context): every key. fp32 inputs stay on MLX's path. Checked on the GPU against
`reference` by scripts/fewq_check.py (worst |error| 0.0039 over its 36 cases, bf16, session 21).
"""

from __future__ import annotations

import math
import zlib

import mlx.core as mx

TILE = 64  # keys a block holds at once
THREADS = 256
MAX_QUERIES = 16
MAX_ROWS = 64  # query heads per KV head x MAX_QUERIES: what a block's shared memory holds
HEAD_DIMS = (64, 128)
DTYPES = (mx.bfloat16, mx.float16)  # the tensor cores' inputs; fp32 stays on MLX's path
TARGET_BLOCKS = 264  # ~2 blocks per SM of an H100/H200 (132 SMs)

_PASS1 = """
    namespace wm = nvcuda::wmma;
    constexpr int TK = 64;
    constexpr int NT = 256;
    constexpr int NW = NT / 32;
    const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int Hq = q_shape[1], M = q_shape[2], Hkv = k_shape[1], N = k_shape[2];
    const int G = Hq / Hkv, R = G * M, NC = gridDim.x;
    const int tiles = (N + TK - 1) / TK, tpc = (tiles + NC - 1) / NC;
    const int kbeg = c * tpc * TK, kend = min(N, kbeg + tpc * TK);
    extern __shared__ __align__(128) unsigned char smem_raw[];
    float* Ss = reinterpret_cast<float*>(smem_raw);   // RMAX x TK scores
    float* Os = Ss + RMAX * TK;                       // RMAX x D running weighted sums
    float* ms = Os + RMAX * D;
    float* ls = ms + RMAX;
    float* cs = ls + RMAX;
    T* Qs = reinterpret_cast<T*>(cs + RMAX);          // RMAX x D
    T* Ks = Qs + RMAX * D;                            // TK x D
    T* Vs = Ks + TK * D;                              // TK x D
    T* Ps = Vs + TK * D;                              // RMAX x TK probabilities
    for (int e = tid; e < RMAX * D; e += NT) {
      const int r = e / D, d = e % D, g = r / M, i = r % M;
      Qs[e] = r < R ? q[b * q_strides[0] + (h * G + g) * q_strides[1] + i * q_strides[2] + d * q_strides[3]]
                    : static_cast<T>(0.f);
      Os[e] = 0.f;
    }
    for (int e = tid; e < RMAX * TK; e += NT) Ps[e] = static_cast<T>(0.f);
    for (int r = tid; r < RMAX; r += NT) { ms[r] = -1e30f; ls[r] = 0.f; cs[r] = 1.f; }
    const float sc = scale[0];
    constexpr int VEC = 16 / sizeof(T);
    auto aligned = [](const T* p, const Strides& st) {
      return st[3] == 1 && st[2] % VEC == 0 && st[1] % VEC == 0 && st[0] % VEC == 0
          && reinterpret_cast<size_t>(p) % 16 == 0;
    };
    const bool vec = aligned(k, k_strides) && aligned(v, v_strides);
    for (int t0 = kbeg; t0 < kend; t0 += TK) {
      __syncthreads();
      if (vec) {  // 16-byte loads: 8 bf16 a thread a load
        for (int e = tid; e < TK * D / VEC; e += NT) {
          const int j = e / (D / VEC), d0 = (e % (D / VEC)) * VEC, kj = t0 + j;
          uint4 kx = make_uint4(0, 0, 0, 0), vx = make_uint4(0, 0, 0, 0);
          if (kj < kend) {
            kx = *reinterpret_cast<const uint4*>(k + b * k_strides[0] + h * k_strides[1] + kj * k_strides[2] + d0);
            vx = *reinterpret_cast<const uint4*>(v + b * v_strides[0] + h * v_strides[1] + kj * v_strides[2] + d0);
          }
          *reinterpret_cast<uint4*>(Ks + j * D + d0) = kx;
          *reinterpret_cast<uint4*>(Vs + j * D + d0) = vx;
        }
      } else {
        for (int e = tid; e < TK * D; e += NT) {
          const int j = e / D, d = e % D, kj = t0 + j;
          T kx = static_cast<T>(0.f), vx = static_cast<T>(0.f);
          if (kj < kend) {
            kx = k[b * k_strides[0] + h * k_strides[1] + kj * k_strides[2] + d * k_strides[3]];
            vx = v[b * v_strides[0] + h * v_strides[1] + kj * v_strides[2] + d * v_strides[3]];
          }
          Ks[e] = kx;
          Vs[e] = vx;
        }
      }
      __syncthreads();
      for (int f = warp; f < (RMAX / 16) * (TK / 16); f += NW) {  // S = Q K^T
        const int fi = f / (TK / 16), fj = f % (TK / 16);
        wm::fragment<wm::accumulator, 16, 16, 16, float> acc;
        wm::fill_fragment(acc, 0.f);
        #pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
          wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> fa;
          wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::col_major> fb;
          wm::load_matrix_sync(fa, Qs + fi * 16 * D + kk * 16, D);
          wm::load_matrix_sync(fb, Ks + fj * 16 * D + kk * 16, D);
          wm::mma_sync(acc, fa, fb, acc);
        }
        wm::store_matrix_sync(Ss + fi * 16 * TK + fj * 16, acc, TK, wm::mem_row_major);
      }
      __syncthreads();
      for (int r = warp; r < R; r += NW) {  // online softmax, a warp a row
        const int lim = CAUSAL ? min(kend, N - M + (r % M) + 1) : kend;
        const float s0 = (t0 + lane < lim) ? Ss[r * TK + lane] * sc : -INFINITY;
        const float s1 = (t0 + lane + 32 < lim) ? Ss[r * TK + lane + 32] * sc : -INFINITY;
        float mx = fmaxf(s0, s1);
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, o));
        const float mold = ms[r], mnew = fmaxf(mold, mx);
        const float p0 = __expf(s0 - mnew), p1 = __expf(s1 - mnew);
        float sum = p0 + p1;
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
        Ps[r * TK + lane] = static_cast<T>(p0);
        Ps[r * TK + lane + 32] = static_cast<T>(p1);
        __syncwarp();
        if (lane == 0) {
          const float corr = __expf(mold - mnew);
          cs[r] = corr; ls[r] = ls[r] * corr + sum; ms[r] = mnew;
        }
      }
      __syncthreads();
      for (int e = tid; e < R * D; e += NT) Os[e] *= cs[e / D];
      __syncthreads();
      for (int f = warp; f < (RMAX / 16) * (D / 16); f += NW) {  // O += P V
        const int fi = f / (D / 16), fj = f % (D / 16);
        wm::fragment<wm::accumulator, 16, 16, 16, float> acc;
        wm::load_matrix_sync(acc, Os + fi * 16 * D + fj * 16, D, wm::mem_row_major);
        #pragma unroll
        for (int kk = 0; kk < TK / 16; ++kk) {
          wm::fragment<wm::matrix_a, 16, 16, 16, T, wm::row_major> fa;
          wm::fragment<wm::matrix_b, 16, 16, 16, T, wm::row_major> fb;
          wm::load_matrix_sync(fa, Ps + fi * 16 * TK + kk * 16, TK);
          wm::load_matrix_sync(fb, Vs + kk * 16 * D + fj * 16, D);
          wm::mma_sync(acc, fa, fb, acc);
        }
        wm::store_matrix_sync(Os + fi * 16 * D + fj * 16, acc, D, wm::mem_row_major);
      }
    }
    __syncthreads();
    const size_t base = ((size_t)(b * Hkv + h) * NC + c) * RMAX;
    for (int e = tid; e < R * D; e += NT) opart[base * D + e] = Os[e];
    for (int r = tid; r < R; r += NT) { ml[(base + r) * 2] = ms[r]; ml[(base + r) * 2 + 1] = ls[r]; }
"""

_PASS2 = """
    const int r = blockIdx.x, h = blockIdx.y, b = blockIdx.z, d = threadIdx.x;
    const int Hq = q_shape[1], M = q_shape[2], Hkv = gridDim.y, NC = ml_shape[2];
    const int G = Hq / Hkv, R = G * M;
    if (r >= R) return;
    const size_t base = (size_t)(b * Hkv + h) * NC;
    float mmax = -1e30f;
    for (int c = 0; c < NC; ++c) mmax = fmaxf(mmax, ml[((base + c) * RMAX + r) * 2]);
    float l = 0.f, o = 0.f;
    for (int c = 0; c < NC; ++c) {
      const size_t idx = (base + c) * RMAX + r;
      const float w = __expf(ml[idx * 2] - mmax);
      l += ml[idx * 2 + 1] * w;
      o += opart[idx * D + d] * w;
    }
    const int g = r / M, i = r % M;
    out[(((size_t)b * M + i) * Hq + h * G + g) * D + d] = static_cast<T>(o / l);  // [B, M, Hq, D]
"""

_kernels: dict[str, object] = {}
_scales: dict[float, mx.array] = {}


def _kernel(name: str, inputs: list[str], outputs: list[str], source: str, smem: int = 0,
            header: str = ""):
    """The kernel object, made once per name (this runs in every layer's attention call)."""
    if name not in _kernels:
        jit_name = f"{name}_{zlib.crc32(source.encode()):08x}"  # a changed source: a new JIT name
        _kernels[name] = mx.fast.cuda_kernel(name=jit_name, input_names=inputs, output_names=outputs,
                                            source=source, header=header,
                                            ensure_row_contiguous=False, shared_memory=smem)
    return _kernels[name]


def shared_bytes(rows: int, head_dim: int, itemsize: int) -> int:
    """Pass 1's shared memory: scores, running sums, row stats (fp32); queries, keys, values,
    probabilities (the input dtype)."""
    fp32 = rows * TILE + rows * head_dim + 3 * rows
    return 4 * fp32 + itemsize * (rows * head_dim + 2 * TILE * head_dim + rows * TILE)


def supported(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """Shapes the kernel takes: 4D, 4..16 queries, head dim 64 or 128, at most 4 query heads per KV
    head, bf16 or fp16."""
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape or q.shape[-1] != k.shape[-1]:
        return False
    m, d = q.shape[2], q.shape[3]
    return (4 <= m <= MAX_QUERIES and d in HEAD_DIMS and q.shape[0] == k.shape[0]
            and q.shape[1] % k.shape[1] == 0 and q.shape[1] // k.shape[1] * MAX_QUERIES <= MAX_ROWS
            and q.dtype in DTYPES
            and k.dtype == q.dtype == v.dtype)


def chunks(keys: int, blocks_per_chunk: int) -> int:
    """How many key chunks: about TARGET_BLOCKS blocks in all, none of them empty."""
    tiles = -(-keys // TILE)
    want = max(1, min(tiles, -(-TARGET_BLOCKS // max(blocks_per_chunk, 1))))
    per = -(-tiles // want)
    return -(-tiles // per)


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, causal: bool) -> mx.array:
    """softmax(q k^T * scale [+ causal mask]) v for q [B, Hq, M, D], k/v [B, Hkv, N, D] (N >= M)."""
    b, hq, m, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    rmax = -(-(hq // hkv) * MAX_QUERIES // 16) * 16  # query rows per KV head, whole 16-row tiles
    nc = chunks(n, b * hkv)
    if scale not in _scales:
        _scales[scale] = mx.array([scale], dtype=mx.float32)
    tag = f"{d}_{rmax}_{int(causal)}"
    p1 = _kernel(f"dflash_fewq1mma_{tag}", ["q", "k", "v", "scale"], ["opart", "ml"], _PASS1,
                 shared_bytes(rmax, d, q.dtype.size), header="#include <mma.h>\n")
    opart, ml = p1(inputs=[q, k, v, _scales[scale]],
                   template=[("T", q.dtype), ("D", d), ("RMAX", rmax), ("CAUSAL", causal)],
                   grid=(nc * THREADS, hkv, b), threadgroup=(THREADS, 1, 1),
                   output_shapes=[(b, hkv, nc, rmax, d), (b, hkv, nc, rmax, 2)],
                   output_dtypes=[mx.float32, mx.float32])
    p2 = _kernel(f"dflash_fewq2_{tag}", ["opart", "ml", "q"], ["out"], _PASS2)
    out = p2(inputs=[opart, ml, q], template=[("T", q.dtype), ("D", d), ("RMAX", rmax)],
             grid=(rmax * d, hkv, b), threadgroup=(d, 1, 1),
             output_shapes=[(b, m, hq, d)], output_dtypes=[q.dtype])[0]
    # written position-major: the caller's transpose back to [B, M, Hq*D] is then a free view
    return out.transpose(0, 2, 1, 3)


def reference(q: mx.array, k: mx.array, v: mx.array, scale: float, causal: bool) -> mx.array:
    """The same maths in plain fp32 ops (any device): what the kernel is tested against."""
    b, hq, m, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    qf = q.astype(mx.float32).reshape(b, hkv, (hq // hkv) * m, d)
    s = (qf * scale) @ k.astype(mx.float32).swapaxes(-1, -2)
    if causal:
        pos = mx.tile(mx.arange(n - m, n), hq // hkv)
        s = mx.where(mx.arange(n)[None, :] <= pos[:, None], s, -math.inf)
    out = mx.softmax(s, axis=-1) @ v.astype(mx.float32)
    return out.reshape(b, hq, m, d).astype(q.dtype)
