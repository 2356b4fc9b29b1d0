"""GEAR's power iteration on MLX's CUDA backend: Gram-Schmidt's elementwise steps as one kernel each.

GEAR's low rank (gear_lowrank.py) orthonormalizes the (n, r) iterate Y = R @ right of every
block by modified Gram-Schmidt, r <= GRAM_SCHMIDT_MAX_RANK columns at a time. On the CPU that
runs through mx.compile; on CUDA it does not (gear_lowrank.COMPILE_ON_GPU: nvrtc's default
--fmad=true may contract the projection's v - c * <c, v> into an FMA inside a fused kernel and
change the factors' last bits), so each of its ops is a launch: 45 per orthonormalization at
rank 4 (6 projections of a multiply, a sum, a multiply and a subtract; 4 norms of a multiply, a
sum, a sqrt, a maximum and a divide; a concatenation), 135 per side of a chunk over the 3
steps, 270 of the ~360 a 2048-token chunk's encode builds on CUDA (counted with
`python -m tests.cache.bench_gear_encode`).

What must stay MLX ops to keep the stored bits: the float32 sums <c, v> and |v|^2 (their order is
that of MLX's reduce kernels) and the two matmuls per step. Everything between two rounds of
sums is elementwise and is one kernel here, per row of every block (one CUDA thread per row):
  - `normalize` (column J): c_J = v_J / max(sqrt(|v_J|^2), EPS), written into the iterate, and
    the products c_J * v_k for every later column k, each a contiguous (..., n, 1) array as the
    ops' product was, so MLX sums exactly what it summed before;
  - `project` (after those sums): v_k - c_J * <c_J, v_k> for every later column k, and the
    next column's v * v for its norm's sum.
Every float op is the ops' op in the same order, written with CUDA's round-to-nearest
intrinsics (__fmul_rn, __fsub_rn, __fdiv_rn, __fsqrt_rn), which nvrtc never contracts; the
maximum is MLX's (a NaN norm propagates). The sums are fed arrays of the shape, dtype and
layout the ops fed them, so they are the same reductions. Per orthonormalization at rank 4:
4 normalize + 3 project kernels + 1 multiply + 10 sums = 18 launches instead of 45; the
concatenation goes (the last normalize writes the whole (n, r) result).

Bit for bit the ops' power iteration on the CPU through tests/cache/cuda_emulation.py
(tests/cache/test_gear_encode_kernel.py); on CUDA its `@cuda_test` cases compare with the ops
there; nvcc -arch=sm_90 compiles both kernels without spills (its slow test). Not yet compiled
by nvrtc nor timed on a GPU (no device time this session).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode

# False: the MLX ops instead, whatever the backend (for an A/B on the GPU: the measurement
# modules' `--set gear_encode_kernel.ENABLED=0`).
ENABLED = True
THREADS = 256

# gear_lowrank._orthonormal's floor of a column's norm (a zero column stays zero, no NaN), as
# the float32 MLX rounds the Python scalar to, written as an exact hexadecimal literal.
NORM_FLOOR = 1e-20

_ROUNDING = r"""
#if !defined(__CUDACC__)
// Only for compilers without CUDA's intrinsics (the CPU emulation): plain float ops, which
// round each result once as the _rn intrinsics do (x86-64 without FMA contraction).
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


def _normalize_source(later: int) -> str:
    """c_J = v_J / max(sqrt(s), FLOOR); out row = v with column J replaced by c_J; p_k = c_J * v_k
    for the `later` columns after J (outputs p0, p1, ...)."""
    products = "".join(f"  p{i}[row] = __fmul_rn(c, v[J + {i + 1}]);\n" for i in range(later))
    return _ROW + r"""
  const float norm = __fsqrt_rn(norm_sum[blk]);
  // MLX's maximum: a NaN operand first is returned as is, else the larger (x > y ? x : y).
  const float floor_ = (norm != norm || norm > FLOOR) ? norm : FLOOR;
  const float c = __fdiv_rn(v[J], floor_);
  v[J] = c;
  #pragma unroll
  for (int k = 0; k < R; ++k) out[row * R + k] = v[k];
""" + products


def _project_source(later: int) -> str:
    """v_k - c_J * t_k for the `later` columns k after J (t0, t1, ...: their sums <c_J, v_k>);
    q = v_{J+1} * v_{J+1} after the projection."""
    updates = "".join(
        f"  v[J + {i + 1}] = __fsub_rn(v[J + {i + 1}], __fmul_rn(v[J], t{i}[blk]));\n" for i in range(later)
    )
    return _ROW + updates + r"""
  #pragma unroll
  for (int k = 0; k < R; ++k) out[row * R + k] = v[k];
  q[row] = __fmul_rn(v[J + 1], v[J + 1]);
"""


def _floor_constant() -> str:
    floor32 = mx.array(NORM_FLOOR, dtype=mx.float32).item()
    return f"  constexpr float FLOOR = {float(floor32).hex()}f;\n"


@lru_cache(maxsize=None)
def _normalize_kernel(later: int):
    return mx.fast.cuda_kernel(
        name=f"vq_gear_gs_normalize_{later}",
        input_names=["w", "norm_sum"],
        output_names=["out", *(f"p{i}" for i in range(later))],
        source=_floor_constant() + _normalize_source(later),
        header=_ROUNDING,
    )


@lru_cache(maxsize=None)
def _project_kernel(later: int):
    return mx.fast.cuda_kernel(
        name=f"vq_gear_gs_project_{later}",
        input_names=["w", *(f"t{i}" for i in range(later))],
        output_names=["out", "q"],
        source=_project_source(later),
        header=_ROUNDING,
    )


def enabled() -> bool:
    """Whether the power iteration's Gram-Schmidt runs through these kernels (MLX's CUDA backend,
    kernels on: fused_decode.kernels_enabled, VELOXQUANT_CUDA_KERNELS) and ENABLED."""
    return ENABLED and fused_decode.kernels_enabled()


def _launch(kernel, w: mx.array, extra: list, J: int, n_outputs: int) -> list:
    """w (..., n, R) float32; extra: the per-block sums (..., 1, 1). Returns [out (w's shape),
    then n_outputs - 1 arrays (..., n, 1)]."""
    *lead, n, R = w.shape
    rows = w.size // R
    column = (*lead, n, 1)
    return kernel(
        inputs=[w.reshape(rows, R), *extra],
        template=[("N", n), ("R", R), ("J", J)],
        grid=(-(-rows // THREADS) * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[w.shape] + [column] * (n_outputs - 1),
        output_dtypes=[mx.float32] * n_outputs,
    )


def orthonormal(y: mx.array) -> mx.array:
    """y (..., n, r) float32 -> its columns orthonormalized by modified Gram-Schmidt, bit for bit
    gear_lowrank._orthonormal's ops for r <= GRAM_SCHMIDT_MAX_RANK (the sums stay MLX's)."""
    r = y.shape[-1]
    w = y
    first = y[..., 0:1]
    norm_sum = mx.sum(first * first, axis=-2, keepdims=True)  # the ops' first v * v and its sum
    for J in range(r):
        later = r - 1 - J
        w, *products = _launch(_normalize_kernel(later), w, [norm_sum], J, 1 + later)
        if not later:
            break
        sums = [mx.sum(p, axis=-2, keepdims=True) for p in products]
        w, q = _launch(_project_kernel(later), w, sums, J, 2)
        norm_sum = mx.sum(q, axis=-2, keepdims=True)
    return w
