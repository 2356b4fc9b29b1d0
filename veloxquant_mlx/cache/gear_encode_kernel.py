"""GEAR's chunk encode on MLX's CUDA backend: its elementwise runs between reductions as kernels.

Since session 17 the power iteration on CUDA is gear_power_kernel.py (one launch per side, its
own order of sums) wherever that kernel takes the shape; the Gram-Schmidt kernels below are the
path for the shapes it refuses and with gear_power_kernel.ENABLED = False, and keep the ops'
bits. The sparse part below runs either way.

On CUDA gear's encode (gear_encoder.py) built 376 primitives for a later 2048-token chunk of one
8 x 128 layer in bf16, and the same for a 256-token decode flush (~342 launches on a GPU, where
mx.dequantize is one kernel; `python -m tests.cache.bench_gear_encode`, which counts them on the
CPU). Most were the power iteration's: gear_lowrank.COMPILE_ON_GPU keeps it out of mx.compile
there (nvrtc's default --fmad=true may contract the projection's v - c * <c, v> into an FMA in a
fused kernel and change the factors' last bits), so its modified Gram-Schmidt was 45 launches per
orthonormalization at rank 4 (6 projections of a multiply, a sum, a multiply and a subtract; 4
norms of a multiply, a sum, a sqrt, a maximum and a divide; a concatenation), 270 per chunk over
3 steps and 2 sides.

What must stay MLX ops to keep the stored bits: the float32 sums <c, v> and |v|^2 (their order is
that of MLX's reduce kernels), the matmuls, the argpartition and mx.quantize / mx.dequantize.
Between two rounds of sums everything is elementwise, and is one kernel here (one CUDA thread
per row of every block, the iterate read as (rows, r)):
  - `normalize` (column J): c_J = v_J / max(sqrt(|v_J|^2), FLOOR), written into the iterate, and
    the products c_J * v_k for every later column k, each its own contiguous (..., n, 1) array
    as the ops' product was, so MLX sums exactly what it summed before;
  - `project` (after those sums): v_k - c_J * <c_J, v_k> for every later column k, and the next
    column's v * v for its norm's sum.
Per orthonormalization at rank r: r normalize + (r - 1) project kernels + the first column's
multiply + r (r + 1) / 2 sums (one per column; 2r - 1 with BATCHED_SUMS, one per round):
15 launches at rank 4 instead of 45 (18 with a sum per column); the last normalize writes the
whole (n, r) result (no concatenation).
And the sparse part (`sparse_part`): per outlier, its correction blocks[p] - (Q(D)[p] + (A B^T)[p])
cast to the side dtype and its position to the index dtype, reading only the outliers' entries;
the ops added A B^T to Q(D) and subtracted from the blocks over the whole side (two float32
passes) before a gather and two casts: 5 launches per side, now 1.
Every float op is the ops' op in the same order, written with CUDA's round-to-nearest intrinsics
(__fadd_rn, __fmul_rn, __fsub_rn, __fdiv_rn, __fsqrt_rn), which nvrtc never contracts; the maximum
is MLX's (a NaN operand first propagates). Counted (bench_gear_encode, results/gear_encode_s6.json):
a later chunk's encode 376 -> 188 primitives in bf16 (374 -> 186 in float32; GPU estimate,
mx.dequantize one kernel, 342 -> 154; 206 / 172 with BATCHED_SUMS off), the same per 256-token
decode flush; host syncs 0 before and after; traces unchanged
(the compiled stages once per chunk shape; the kernels are not traced, and JIT-compile once per
template: 7 Gram-Schmidt kernels per way of summing and one sparse kernel per side dtype).
Not timed on a GPU.

Bit for bit the ops on the CPU through tests/cache/cuda_emulation.py
(tests/cache/test_gear_encode_kernel.py, also against the frozen encoder of main 2e28496); on
CUDA its `@cuda_test` cases compare with the ops and the frozen encoder there; nvcc
-arch=sm_90 compiles every kernel (both ways of summing) without spills (its slow test). Not yet compiled by nvrtc
nor timed on a GPU (no device time this session).
"""

from __future__ import annotations

import struct
from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode, kernel_header
from veloxquant_mlx.cache.kernel_name import build_kernel
from veloxquant_mlx.errors import QuantizerConfigError

# False: the MLX ops instead, whatever the backend (for an A/B on the GPU: the measurement
# modules' `--set gear_encode_kernel.ENABLED=0`).
ENABLED = True
THREADS = 256
# One MLX sum per round of projections (the later columns' products stacked, (later, ..., n, 1))
# instead of one per column: the same rows of n contiguous floats, reduced in the same order by
# MLX's row reduction whatever their number (its CUDA row_reduce_simple: one row per thread block,
# two above 1024 rows, the same per-row order; equal on the CPU, tested), 3 launches fewer per
# orthonormalization at rank 4. Off by default until a GPU run confirms the bits there
# (tests/cache/test_gear_encode_kernel.py's CUDA cases, both ways; `--set
# gear_encode_kernel.BATCHED_SUMS=1` for the A/B): off, one sum per column, each on an array shaped
# as the ops' own, so the same reduction whatever MLX's row-reduction strategy.
BATCHED_SUMS = False

# gear_lowrank._orthonormal's floor of a column's norm (a zero column stays zero, no NaN), as
# the float32 MLX rounds the Python scalar to, written as an exact hexadecimal literal.
NORM_FLOOR = 1e-20

_ROUNDING = r"""
#if !defined(__CUDACC__)
// Only for compilers without CUDA's intrinsics (the CPU emulation): plain float ops, which
// round each result once as the _rn intrinsics do (x86-64 without FMA contraction).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
#endif
"""

# One thread per row of the iterate, viewed as (rows, R): rows = blocks x n tokens, a block's n
# rows contiguous. `w_shape` makes MLX pass the iterate's shape (rows is its first entry).
_ROW = r"""
  const size_t row = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t rows = (size_t)w_shape[0];
  if (row >= rows) return;
  const size_t blk = row / (size_t)N;
  float v[R];
  #pragma unroll
  for (int k = 0; k < R; ++k) v[k] = w[row * R + k];
"""


def _product_at(i: int, batched: bool) -> str:
    """Where the i-th later column's product goes: its own (rows) output, or row i of one
    (later, rows) output (BATCHED_SUMS)."""
    return f"p[(size_t){i} * rows + row]" if batched else f"p{i}[row]"


def _sum_at(i: int, batched: bool) -> str:
    """Where the i-th later column's sum <c_J, v_k> is read: its own (blocks) input, or row i of
    one (later, blocks) input (BATCHED_SUMS)."""
    return f"t[(size_t){i} * (rows / N) + blk]" if batched else f"t{i}[blk]"


def _normalize_source(later: int, batched: bool) -> str:
    """c_J = v_J / max(sqrt(s), FLOOR); out row = v with column J replaced by c_J; the products
    c_J * v_k of the `later` columns after J."""
    products = "".join(f"  {_product_at(i, batched)} = __fmul_rn(c, v[J + {i + 1}]);\n" for i in range(later))
    return _ROW + r"""
  const float norm = __fsqrt_rn(norm_sum[blk]);
  // MLX's maximum: a NaN operand first is returned as is, else the larger (x > y ? x : y).
  const float floor_ = (norm != norm || norm > FLOOR) ? norm : FLOOR;
  const float c = __fdiv_rn(v[J], floor_);
  v[J] = c;
  #pragma unroll
  for (int k = 0; k < R; ++k) out[row * R + k] = v[k];
""" + products


def _project_source(later: int, batched: bool) -> str:
    """v_k - c_J * <c_J, v_k> for the `later` columns k after J; q = v_{J+1} * v_{J+1} after it."""
    updates = "".join(
        f"  v[J + {i + 1}] = __fsub_rn(v[J + {i + 1}], __fmul_rn(v[J], {_sum_at(i, batched)}));\n"
        for i in range(later)
    )
    return _ROW + updates + r"""
  #pragma unroll
  for (int k = 0; k < R; ++k) out[row * R + k] = v[k];
  q[row] = __fmul_rn(v[J + 1], v[J + 1]);
"""


def floor_constant() -> str:
    # The float32 nearest NORM_FLOOR (MLX's rounding of the Python scalar), as an exact literal.
    floor32 = struct.unpack("<f", struct.pack("<f", NORM_FLOOR))[0]
    return f"  constexpr float FLOOR = {floor32.hex()}f;\n"


@lru_cache(maxsize=None)
def _normalize_kernel(later: int, batched: bool):
    products = (["p"] if later else []) if batched else [f"p{i}" for i in range(later)]
    return build_kernel(
        mx.fast.cuda_kernel,
        name=f"vq_gear_gs_normalize_{later}" + ("_batched" if batched and later else ""),
        input_names=["w", "norm_sum"],
        output_names=["out", *products],
        source=floor_constant() + _normalize_source(later, batched),
        header=_ROUNDING,
    )


@lru_cache(maxsize=None)
def _project_kernel(later: int, batched: bool):
    return build_kernel(
        mx.fast.cuda_kernel,
        name=f"vq_gear_gs_project_{later}" + ("_batched" if batched and later else ""),
        input_names=["w", *(["t"] if batched else [f"t{i}" for i in range(later)])],
        output_names=["out", "q"],
        source=_project_source(later, batched),
        header=_ROUNDING,
    )


def enabled() -> bool:
    """Whether gear's encode runs through these kernels (the power iteration's Gram-Schmidt and
    the sparse part): MLX's CUDA backend, kernels on (fused_decode.kernels_enabled,
    VELOXQUANT_CUDA_KERNELS), and ENABLED."""
    return ENABLED and fused_decode.kernels_enabled()


def _launch(kernel, w: mx.array, extra: list, J: int, column_shapes: list) -> list:
    """w (..., n, R) float32; extra: the per-block sums. Returns [out (w's shape), then one
    float32 array per shape of `column_shapes`]."""
    rows = w.size // w.shape[-1]
    return kernel(
        inputs=[w.reshape(rows, w.shape[-1]), *extra],
        template=[("N", w.shape[-2]), ("R", w.shape[-1]), ("J", J)],
        grid=(-(-rows // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[w.shape, *column_shapes],
        output_dtypes=[mx.float32] * (1 + len(column_shapes)),
    )


def orthonormal(y: mx.array) -> mx.array:
    """y (..., n, r) float32 -> its columns orthonormalized by modified Gram-Schmidt, bit for bit
    gear_lowrank._orthonormal's ops for r <= GRAM_SCHMIDT_MAX_RANK (the sums stay MLX's)."""
    r = y.shape[-1]
    column = (*y.shape[:-1], 1)
    batched = BATCHED_SUMS
    w = y
    first = y[..., 0:1]
    norm_sum = mx.sum(first * first, axis=-2, keepdims=True)  # the ops' first v * v and its sum
    for J in range(r):
        later = r - 1 - J
        shapes = ([(later, *column)] if later else []) if batched else [column] * later
        w, *products = _launch(_normalize_kernel(later, batched), w, [norm_sum], J, shapes)
        if not later:
            break
        sums = [mx.sum(p, axis=-2, keepdims=True) for p in products]
        w, q = _launch(_project_kernel(later, batched), w, sums, J, [column])
        norm_sum = mx.sum(q, axis=-2, keepdims=True)
    return w


# ---- the sparse part -------------------------------------------------------------------------
# gear_encoder's stage 3 with the low rank's add folded in: per outlier of a block, its stored
# correction blocks[p] - (approx[p] + low[p]) cast to the side dtype, and its position cast to the
# index dtype. As ops that is an add and a subtract over the whole (n, d) side (two float32
# passes), a gather and two casts: 5 launches per side; here one, which reads only the outliers'
# entries. One thread per outlier; the add and subtract are the ops' (float32, rounded once each).
# LOW: 0 no low rank; 1 low[p] read from the (n, d) float32 product A B^T the ops made; 2 low[p]
# computed here from the stored factors (side dtype): A's row t and B's row c of the entry
# p = t * DIM + c, r = 0, 1, ... summed from 0, a rounding per product and per sum: what a
# sequential K = RANK sgemm gives (the CPU's matmul: the emulated tests compare) and what
# gear_prefill_kernel.py adds back when it decodes the entry.
_SPARSE_SOURCE = r"""
  const size_t o = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t total = (size_t)index_shape[0] * index_shape[1] * index_shape[2] * NO;
  if (o >= total) return;
  const size_t blk = o / NO;
  const int p = index[o];
  const size_t at = blk * E + (size_t)p;
  float fitted = approx[at];
  if (LOW == 1) fitted = __fadd_rn(fitted, low[at]);
  if (LOW == 2) {
    const int t = p / DIM, c = p - t * DIM;
    const size_t a0 = (blk * (E / DIM) + (size_t)t) * RANK, b0 = (blk * DIM + (size_t)c) * RANK;
    float lr = 0.0f;
    for (int j = 0; j < RANK; ++j) lr = __fadd_rn(lr, __fmul_rn(vq_f32(tokens[a0 + j]), vq_f32(channels[b0 + j])));
    fitted = __fadd_rn(fitted, lr);
  }
  values[o] = vq_cast<VT>(__fsub_rn(blocks[at], fitted));
  positions[o] = (IT)p;
"""


@lru_cache(maxsize=None)
def _sparse_kernel():
    return build_kernel(
        mx.fast.cuda_kernel,
        name="vq_gear_sparse_part",
        input_names=["blocks", "approx", "low", "tokens", "channels", "index"],
        output_names=["values", "positions"],
        source=_SPARSE_SOURCE,
        header=kernel_header.HEADER + _ROUNDING,
    )


def sparse_part(blocks: mx.array, approx: mx.array, low: mx.array | None, index: mx.array,
                side_dtype: mx.Dtype, index_dtype: mx.Dtype, factors=None) -> tuple[mx.array, mx.array]:
    """blocks, approx (B, H, n_blocks, nb, d) float32 (the side and Q(D)); low the same shape
    (A B^T as the stored factors give it) or None; `factors` (tokens (B, H, n_blocks * nb, r),
    channels (B, H, n_blocks, d, r), both in side_dtype) to compute A B^T at the outliers from
    instead (not with `low`); neither: no low rank. index (B, H, n_blocks, count) int32 over
    nb * d -> (values (B, H, n_blocks, count) in side_dtype, positions in index_dtype): bit for
    bit gear_encoder's stage 3 after `approx + low` (with `factors`, where `low` would be the
    sequential K = r product of the factors: the CPU's)."""
    B, H, n_blocks, nb, d = blocks.shape
    count = index.shape[-1]
    total = B * H * n_blocks * count
    if low is not None and factors is not None:
        raise QuantizerConfigError("gear sparse part: both `low` and `factors` given; allowed is one of them or neither")
    mode = 1 if low is not None else 2 if factors is not None else 0
    absent_side = fused_decode.absent_input(side_dtype)
    tokens, channels = factors if factors is not None else (absent_side, absent_side)
    rank = tokens.shape[-1] if factors is not None else 0
    return _sparse_kernel()(
        inputs=[blocks, approx, low if low is not None else fused_decode.absent_input(mx.float32), tokens, channels,
                index],
        template=[("E", nb * d), ("DIM", d), ("RANK", rank), ("NO", count), ("LOW", mode), ("VT", side_dtype),
                  ("IT", index_dtype)],
        grid=(-(-total // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[index.shape, index.shape],
        output_dtypes=[side_dtype, index_dtype],
    )
