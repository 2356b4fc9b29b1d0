"""The randomized Hadamard rotation of TurboQuant: y = H (s * x) / sqrt(d).

H is the d x d Walsh-Hadamard matrix (d a power of 2), s a vector of random signs. The map is
orthogonal (H H^T = d I, s * s = 1), so inner products survive it: q . k = (R q) . (R k), and
its inverse is x = s * (H y) / sqrt(d). It spreads a few large ("outlier") channels over all
coordinates, after which each coordinate of a vector of norm r is close to N(0, r^2 / d):
the distribution a scalar quantizer is fitted for. `mx.hadamard_transform` is MLX's fast
Walsh-Hadamard transform (O(d log d), no d x d matrix held). A backend without it (MLX's CUDA
backend gained one only in later sources; whether a given wheel has it is found by one tiny
evaluation per device) gets the same transform as a matmul with the Sylvester matrix H
(H_1 = [1], H_2n = [[H_n, H_n], [H_n, -H_n]]: the order mx.hadamard_transform uses), so codes
written on one backend decode identically on another.
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


_FAST_ON: dict[str, bool] = {}  # device -> whether mx.hadamard_transform evaluates there
_MATRICES: dict = {}


def fast_transform_available() -> bool:
    """Whether mx.hadamard_transform runs on the default device (probed once per device)."""
    device = str(mx.default_device())
    if device not in _FAST_ON:
        try:
            mx.eval(mx.hadamard_transform(mx.ones((1, 4))))
            _FAST_ON[device] = True
        except (RuntimeError, ValueError):  # "Hadamard has no <backend> implementation"
            _FAST_ON[device] = False
    return _FAST_ON[device]


def sylvester_matrix(d: int, dtype: mx.Dtype = mx.float32) -> mx.array:
    """The d x d Walsh-Hadamard matrix of +-1 in mx.hadamard_transform's order (d a power of 2)."""
    if not is_power_of_two(d):
        raise QuantizerConfigError(f"Hadamard rotation dim={d!r} is invalid: allowed is a power of 2")
    key = (d, dtype)
    if key not in _MATRICES:
        h = mx.ones((1, 1), dtype=mx.float32)
        while h.shape[0] < d:
            h = mx.concatenate([mx.concatenate([h, h], 1), mx.concatenate([h, -h], 1)], 0)
        _MATRICES[key] = h.astype(dtype)
    return _MATRICES[key]


def hadamard(x: mx.array, scale: float) -> mx.array:
    """scale * H x along the last axis: the fast transform where the backend has it."""
    if fast_transform_available():
        return mx.hadamard_transform(x, scale=scale)
    return (x @ sylvester_matrix(x.shape[-1], x.dtype)) * scale  # H is symmetric


def rotate(x: mx.array, signs: mx.array) -> mx.array:
    """R x along the last axis (orthonormal)."""
    d = x.shape[-1]
    return hadamard(x * signs.astype(x.dtype), d**-0.5)


def unrotate(y: mx.array, signs: mx.array) -> mx.array:
    """R^T y along the last axis: the inverse of `rotate` (H is symmetric)."""
    d = y.shape[-1]
    return hadamard(y, d**-0.5) * signs.astype(y.dtype)
