"""Rank-r approximation of GEAR's quantization residual by subspace (power) iteration.

GEAR (Kang et al. 2024, arXiv 2403.05527, Sec. 3 and Alg. 1) approximates the residual
R = D - Q(D) of each head with a rank-r product A B^T computed by a few power-iteration
steps instead of a full SVD (their code: `fake_poweriteration`, QR of the last iterate). We do
the same per block of tokens per head: R (nb, d) ~ A (nb, r) B^T (d, r), A with orthonormal
columns, B = R^T A carrying the scale.

Cost, measured on this CPU (2 shared cores, loaded; `python -m veloxquant_mlx.bench.lowrank`): one
side (keys or values) of one layer at a 4096-token prompt of SmolLM2's shape -- 3 heads x 16 blocks
of 256 x 64 -- takes ~2 ms by 3 power-iteration steps with OpenBLAS preloaded (85 ms with the
wheel's reference BLAS), against ~600 ms (1.4 s) for mx.linalg.svd of the same blocks on the CPU
stream, for a residual error within 1.2% of the SVD's (relative error 0.945 vs 0.934 on Gaussian
residuals, where no low-rank structure exists to find). So we follow the paper.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

from veloxquant_mlx.cache import gear_encode_kernel, gear_power_kernel

# Power-iteration steps. The residual of a uniform quantizer is close to noise; its leading
# directions (outlier channels, a shared offset) separate quickly, and the paper's code uses a
# handful of loops. Three steps reach within a few percent of the SVD's error on our data
# (tests/cache/test_gear.py checks that the low-rank term removes error).
POWER_STEPS = 3


def low_rank_factors(residual: mx.array, rank: int, steps: int = POWER_STEPS):
    """residual (..., n, d) float32 -> (A (..., n, r), B (..., d, r)) with residual ~ A @ B^T."""
    if takes_power_kernel(*residual.shape[-2:], rank):
        # On CUDA: every step of a block in one kernel (gear_power_kernel.py); the factors
        # differ from the ops' in their last bits (the order of its sums).
        return kernel_factors([residual], rank, steps=steps)[0]
    start = start_matrix(residual.shape[-1], rank)
    if rank <= GRAM_SCHMIDT_MAX_RANK and _compile_here():
        return _compiled_iteration(rank, steps)(residual, start)
    if rank <= GRAM_SCHMIDT_MAX_RANK and gear_encode_kernel.enabled():
        # On CUDA, uncompiled: Gram-Schmidt's elementwise steps as kernels, its sums MLX's.
        return _power_iteration(residual, rank, steps, start, orthonormal=gear_encode_kernel.orthonormal)
    return _power_iteration(residual, rank, steps, start)


def kernel_factors(residuals: list[mx.array], rank: int, dtype: mx.Dtype = mx.float32,
                   steps: int = POWER_STEPS) -> list[tuple[mx.array, mx.array]]:
    """low_rank_factors through gear_power_kernel.py (where takes_power_kernel) of one residual,
    or of two of one block shape in one launch (factors_pair: GEAR's keys and values), the
    factors in `dtype`."""
    start = start_matrix(residuals[0].shape[-1], rank)
    if len(residuals) == 2:
        return list(gear_power_kernel.factors_pair(*residuals, start, steps, dtype))
    return [gear_power_kernel.factors(residuals[0], start, steps, dtype)]


def takes_power_kernel(n: int, d: int, rank: int) -> bool:
    """Whether low_rank_factors of (..., n, d) residuals at `rank` runs gear_power_kernel.py here
    (CUDA, kernels on, a shape it takes; the ranks Gram-Schmidt handles)."""
    return rank <= GRAM_SCHMIDT_MAX_RANK and gear_power_kernel.applies(n, d, rank)


def start_matrix(d: int, rank: int) -> mx.array:
    """The power iteration's fixed (d, rank) start: a fixed start makes encoding deterministic
    (state round trips and tests repeat exactly). Drawn once per shape and device and kept
    (it used to be drawn again per call: a few random-bit ops per side of every chunk); per
    device because the normal transform's last bits could differ between devices."""
    # Keyed by the device's repr: mx.Device hashes by identity, and default_device() returns a
    # new object per call.
    return _start_matrix(d, rank, repr(mx.default_device()))


@lru_cache(maxsize=None)
def _start_matrix(d: int, rank: int, device: str) -> mx.array:
    start = mx.random.normal((d, rank), key=mx.random.key(0x6EA2))
    mx.eval(start)
    return start


def _power_iteration(residual: mx.array, rank: int, steps: int, start: mx.array | None = None, orthonormal=None):
    """`orthonormal`: what orthonormalizes each iterate (default _orthonormal, the MLX ops)."""
    orthonormal = orthonormal or _orthonormal
    n, d = residual.shape[-2:]
    if start is None:
        start = start_matrix(d, rank)
    right = mx.broadcast_to(start, (*residual.shape[:-2], d, rank))
    left = None
    for _ in range(steps):
        left = orthonormal(residual @ right)
        right = residual.swapaxes(-1, -2) @ left
    return left, right


# Up to this rank the columns are orthonormalized by Gram-Schmidt in plain MLX ops (a few
# batched elementwise ops per column, on any device); above it by LAPACK QR on the CPU stream.
GRAM_SCHMIDT_MAX_RANK = 8

# The power iteration runs through mx.compile on the CPU: uncompiled, Gram-Schmidt is ~45 ops on
# one column of every block per step (~150 per side of a chunk at rank 4, each a pass or a
# kernel launch); compiled, the elementwise ones between its reductions fuse. On the CPU that is
# bit-identical (MLX builds its fused CPU kernels with g++ -O3 for baseline x86-64: no FMA).
# On CUDA it is off until checked there: MLX's JIT compiles fused kernels with nvrtc's default
# --fmad=true, and the projection v - c * <c, v> is the one product-then-add of the encoder
# whose product is inexact, so a contracted FMA could change the factors' last bits. Set
# COMPILE_ON_GPU = True and run tests/cache/test_encoder_identity.py on the GPU to check. Meanwhile
# on CUDA the whole iteration of a block is one kernel (gear_power_kernel.py, since session 17:
# its own order of sums, so not these bits), and where that kernel does not take the shape the
# Gram-Schmidt steps between its sums run as kernels with round-to-nearest intrinsics
# (gear_encode_kernel.py: 15 launches per orthonormalization at rank 4 instead of 45).
COMPILE_ON_GPU = False


def _compile_here() -> bool:
    return COMPILE_ON_GPU or mx.default_device() == mx.cpu


@lru_cache(maxsize=None)
def _compiled_iteration(rank: int, steps: int):
    return mx.compile(lambda residual, start: _power_iteration(residual, rank, steps, start))


def _orthonormal(y: mx.array) -> mx.array:
    rank = y.shape[-1]
    if rank > GRAM_SCHMIDT_MAX_RANK:
        q, _ = mx.linalg.qr(y, stream=mx.cpu)
        return q
    columns = []
    for j in range(rank):
        v = y[..., j : j + 1]
        for c in columns:
            v = v - c * mx.sum(c * v, axis=-2, keepdims=True)
        # A residual of rank < r (e.g. a constant block) leaves a zero column, not a NaN.
        norm = mx.sqrt(mx.sum(v * v, axis=-2, keepdims=True))
        columns.append(v / mx.maximum(norm, 1e-20))
    return mx.concatenate(columns, axis=-1)
