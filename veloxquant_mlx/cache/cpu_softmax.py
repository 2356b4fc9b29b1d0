"""The attention probabilities on the CPU: a softmax whose exponential is a polynomial.

Why (timed in session 40's scripts, not kept, on the project's Xeon VM): MLX's CPU `exp`
(0.32) costs ~11.5 ns per element, ~45x a multiply (0.25 ns), and mx.softmax is almost all of
it: over one decode step's scores of SmolLM2's layer (9 query rows x 2112 columns, float32) it
took 227 us, as long as the whole weighted sum of kivi's 2-bit values; at the 8B attention shape
and 8448 columns 3.2 ms. Here the exponential is Cephes' expf written as MLX ops (x = n ln2 + r
with |r| <= ln2 / 2, a degree-6 polynomial in r, 2^n put into the float's exponent bits), the
polynomial compiled into one fused kernel: 127 us and 1.78 ms at those shapes (session 40, one
core; medians). The exponential is within one float32 ulp of e^x from 0 down to its underflow
(MLX's own exp errs by up to 3.8e-6 relative there); the probabilities are within a few ulp of
mx.softmax's (tests/cache/test_cpu_softmax.py).

Where: the CPU only, and only for scores of at least MIN_ELEMENTS elements: the compiled
function costs ~45 us per call whatever the size, so small score matrices (the first steps, a
short context) keep mx.softmax (crossover measured at 4-5K elements: 9 rows x 512 columns, 32
rows x 128). On Metal and CUDA mx.softmax is one fast kernel.

The polynomial is compiled shapeless (the score matrix widens by one column every decode step:
a compile per shape would trace at every step); the exponent bits are set outside it (a view
cannot be traced shapeless).
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx

# Scores (rows x columns, all leading axes) from which the polynomial path runs.
MIN_ELEMENTS = 8192
LOG2E = 1.44269504088896341
# ln 2 split in two (Cephes): n * LN2_HIGH is exact for the n a float32 exponent takes.
LN2_HIGH = 0.693359375
LN2_LOW = -2.12194440e-4
# exp(x) for x below this is under float32's smallest normal: taken as 0, as MLX's exp rounds it.
UNDERFLOW = -87.33654
# Cephes expf's coefficients of (e^r - 1 - r) / r^2, highest degree first.
COEFFICIENTS = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                1.6666665459e-1, 5.0000001201e-1)


def applies(scores: mx.array) -> bool:
    """Whether the polynomial path serves these scores: the CPU, float32, MIN_ELEMENTS or more."""
    return (scores.dtype == mx.float32 and scores.size >= MIN_ELEMENTS
            and mx.default_device().type == mx.DeviceType.cpu)


def softmax(scores: mx.array) -> mx.array:
    """softmax over the last axis of float32 `scores` (mx.softmax(scores, axis=-1, precise=True)
    where `applies` says no)."""
    if not applies(scores):
        return mx.softmax(scores, axis=-1, precise=True)
    shifted = scores - scores.max(-1, keepdims=True)
    e = scaled(*_polynomial()(shifted))
    return e / e.sum(-1, keepdims=True)


def scaled(mantissa: mx.array, exponent: mx.array) -> mx.array:
    """mantissa * 2^exponent for _reduced's output, the exponent written into the float's bits
    (outside the shapeless trace: a view cannot be traced shapeless)."""
    return mantissa * mx.left_shift(exponent.astype(mx.int32) + 127, 23).view(mx.float32)


def _reduced(x: mx.array) -> tuple[mx.array, mx.array]:
    """For x <= 0: (e^r, n) with x = n ln2 + r, e^r set to 0 where e^x underflows (there n is
    clamped to -126, so that 2^n stays a normal float's exponent)."""
    n = mx.maximum(mx.floor(x * LOG2E + 0.5), -126.0)
    r = (x - n * LN2_HIGH) - n * LN2_LOW
    y = COEFFICIENTS[0]
    for c in COEFFICIENTS[1:]:
        y = y * r + c
    y = y * (r * r) + r + 1.0
    return mx.where(x < UNDERFLOW, 0.0, y), n


@lru_cache(maxsize=None)
def _polynomial():
    # Python floats only: a lazy constant would belong to the stream of the thread that first
    # traced this (the demo's two generations run in two threads, each in its own stream).
    return mx.compile(_reduced, shapeless=True)
