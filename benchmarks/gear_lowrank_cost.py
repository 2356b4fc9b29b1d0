"""Cost and error of GEAR's rank-4 residual approximation: power iteration vs mx.linalg.svd,
for one side of one layer at a 4096-token prompt of SmolLM2's shape (3 heads x 16 blocks of
256 tokens x head_dim 64), on Gaussian residuals.

Run: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
       /work/venv/bin/python benchmarks/gear_lowrank_cost.py
"""

import time

import mlx.core as mx

from veloxquant_mlx.cache.gear_lowrank import low_rank_factors

R = mx.random.normal((1, 3, 16, 256, 64), key=mx.random.key(0))
mx.eval(R)


def power_iteration():
    a, b = low_rank_factors(R, 4)
    return a, b.swapaxes(-1, -2)


def svd():
    u, s, vt = mx.linalg.svd(R, stream=mx.cpu)
    return u[..., :4] * s[..., None, :4], vt[..., :4, :]


for name, fn in (("power iteration (3 steps)", power_iteration), ("mx.linalg.svd", svd)):
    a, b = fn()
    rel = (mx.linalg.norm((R - a @ b).reshape(-1)) / mx.linalg.norm(R.reshape(-1))).item()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"{name}: relative error {rel:.4f}, min {times[0] * 1e3:.1f} ms, median {times[2] * 1e3:.1f} ms")
