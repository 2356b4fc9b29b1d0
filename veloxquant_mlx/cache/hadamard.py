"""The randomized Hadamard rotation of TurboQuant: y = H (s * x) / sqrt(d).

H is the d x d Walsh-Hadamard matrix (d a power of 2), s a vector of random signs. The map is
orthogonal (H H^T = d I, s * s = 1), so inner products survive it: q . k = (R q) . (R k), and
its inverse is x = s * (H y) / sqrt(d). It spreads a few large ("outlier") channels over all
coordinates, after which each coordinate of a vector of norm r is close to N(0, r^2 / d):
the distribution a scalar quantizer is fitted for. `mx.hadamard_transform` is MLX's fast
Walsh-Hadamard transform (O(d log d), no d x d matrix held).
"""

from __future__ import annotations

import mlx.core as mx

from veloxquant_mlx.errors import QuantizerConfigError


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def random_signs(seed: int, stream: int, dim: int) -> mx.array:
    """dim random +-1.0 (float32) from (seed, stream); the same arguments give the same signs,
    so a cache rebuilt from its state rotates exactly as the one that wrote it."""
    if not is_power_of_two(dim):
        raise QuantizerConfigError(f"Hadamard rotation dim={dim!r} is invalid: allowed is a power of 2")
    key = mx.random.split(mx.random.key(seed), stream + 1)[stream]
    bits = mx.random.bernoulli(0.5, (dim,), key=key)
    return mx.where(bits, 1.0, -1.0).astype(mx.float32)


def rotate(x: mx.array, signs: mx.array) -> mx.array:
    """R x along the last axis (orthonormal)."""
    d = x.shape[-1]
    return mx.hadamard_transform(x * signs.astype(x.dtype), scale=d**-0.5)


def unrotate(y: mx.array, signs: mx.array) -> mx.array:
    """R^T y along the last axis: the inverse of `rotate` (H is symmetric)."""
    d = y.shape[-1]
    return mx.hadamard_transform(y, scale=d**-0.5) * signs.astype(y.dtype)
