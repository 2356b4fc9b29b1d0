"""Each method's fused decode step against its portable step on the same cache (MLX's CUDA backend).

    python -m veloxquant_mlx.bench.fused_check --methods kivi,xquant,gear,turboquant_rvq,kvquant

One cache per method (layer 0 of 2, the 8B shape: 8 KV heads x head_dim 128, 4 query rows per KV
head, bf16) takes a 700-token prompt, then `--steps` decode steps; at each, the attention of one
query row with the kernels on (VELOXQUANT_CUDA_KERNELS=1) and off (0: the portable ops), and
the largest absolute difference. Successive steps reuse the cache's fused-launch state (counters
that every launch must leave at zero, the partials' scratch), which a single step would not
check. Why a command beside the `pytest -m cuda` tests: one process per method can run in
parallel on the device and print as soon as its kernels are compiled (5-100 s of JIT each), where
the test files compile many shapes each. On the CPU the two paths are the same ops: it refuses.
Cross-layer methods (minicache, pyramidkv) are refused: a standalone cache of theirs at layer 0
attends exactly (a plain layer), which would compare nothing; their kernels are checked by the
CPU emulation (tests/cache/test_fused_decode_minicache_emulated.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import mlx.core as mx

from veloxquant_mlx.cache import fused_decode

METHODS = ("kivi", "xquant", "gear", "turboquant_rvq", "kvquant")
KV_HEADS, HEAD_DIM, ROWS, PROMPT = 8, 128, 4, 700


def max_step_differences(method: str, steps: int) -> list[float]:
    """Per step, max |fused - portable| of one query row's attention on one cache."""
    from veloxquant_mlx.cache.factory import KVCacheFactory
    from veloxquant_mlx.config import KVCacheConfig

    cache = KVCacheFactory.create(KVCacheConfig(method=method), layer_index=0, n_layers=2)
    mx.random.seed(0)
    shape = (1, KV_HEADS, PROMPT + steps, HEAD_DIM)
    keys = mx.random.normal(shape).astype(mx.bfloat16)
    values = mx.random.normal(shape).astype(mx.bfloat16)
    cache.update_and_fetch(keys[:, :, :PROMPT], values[:, :, :PROMPT])
    differences = []
    for step in range(steps):
        at = PROMPT + step
        cache.update_and_fetch(keys[:, :, at:at + 1], values[:, :, at:at + 1])
        q = mx.random.normal((1, KV_HEADS * ROWS, 1, HEAD_DIM)).astype(mx.bfloat16)
        outs = []
        for switch in ("1", "0"):
            os.environ[fused_decode.ENV_SWITCH] = switch
            outs.append(cache.attention(q, scale=HEAD_DIM ** -0.5))
            mx.eval(outs[-1])
        os.environ[fused_decode.ENV_SWITCH] = "1"
        differences.append(mx.abs(outs[0].astype(mx.float32) - outs[1].astype(mx.float32)).max().item())
    return differences


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m veloxquant_mlx.bench.fused_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    parser.add_argument("--steps", type=int, default=3, help="decode steps checked (default 3)")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods {args.methods}: {unknown} not checkable; allowed are {', '.join(METHODS)} "
                     "(cross-layer methods: see the module docstring)")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: allowed is an integer >= 1")
    if not fused_decode._on_cuda():
        print("fused_check: needs MLX's CUDA backend as the default device (here the kernels never run)",
              file=sys.stderr)
        return 2
    for method in methods:
        t0 = time.perf_counter()
        differences = max_step_differences(method, args.steps)
        print(f"CHECK {method}: max |fused - portable| per step = {', '.join(f'{d:.3g}' for d in differences)} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
