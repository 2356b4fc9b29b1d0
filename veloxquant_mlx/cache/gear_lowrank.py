"""Rank-r approximation of GEAR's quantization residual by subspace (power) iteration.

GEAR (Kang et al. 2024, arXiv 2403.05527, Sec. 3 and Alg. 1) approximates the residual
R = D - Q(D) of each head with a rank-r product A B^T computed by a few power-iteration
steps instead of a full SVD (their code: `fake_poweriteration`, QR of the last iterate). We do
the same per block of tokens per head: R (nb, d) ~ A (nb, r) B^T (d, r), A with orthonormal
columns, B = R^T A carrying the scale.

Cost (measured on this CPU, 2 cores, see results/gear_speed.json): for a 4096-token prompt of
SmolLM2's shape (3 KV heads, head_dim 64, 16 blocks of 256 tokens per head) the power
iteration of keys and values for one layer takes a few ms, small next to the prompt's forward
pass; mx.linalg.svd of the same blocks is several times slower, which is why we follow the
paper here.
"""

from __future__ import annotations

import mlx.core as mx

# Power-iteration steps. The residual of a uniform quantizer is close to noise; its leading
# directions (outlier channels, a shared offset) separate quickly, and the paper's code uses a
# handful of loops. Three steps reach within a few percent of the SVD's error on our data
# (tests/cache/test_gear.py checks that the low-rank term removes error).
POWER_STEPS = 3


def low_rank_factors(residual: mx.array, rank: int, steps: int = POWER_STEPS):
    """residual (..., n, d) float32 -> (A (..., n, r), B (..., d, r)) with residual ~ A @ B^T."""
    n, d = residual.shape[-2:]
    # A fixed start makes encoding deterministic (state round trips and tests repeat exactly).
    start = mx.random.normal((d, rank), key=mx.random.key(0x6EA2))
    right = mx.broadcast_to(start, (*residual.shape[:-2], d, rank))
    left = None
    for _ in range(steps):
        left = _orthonormal(residual @ right)
        right = residual.swapaxes(-1, -2) @ left
    return left, right


def _orthonormal(y: mx.array) -> mx.array:
    # QR runs on the CPU stream only; these are small (nb x r) matrices.
    q, _ = mx.linalg.qr(y, stream=mx.cpu)
    return q
