"""One layer's decode-step attention products over the compressed form, timed per op.

For KVQuantCache and GEARCache: `_scores(q)` and `_weighted_values(p)` of one decode step
(B=1, 8 KV heads, 32 query heads folded into 4 rows per KV head, head_dim 128), each evaluated
on its own, `--repeats` times after a warm-up; prints median, min and max in ms. Also the fp16
(input dtype) reference: q @ K^T and p @ V on the uncompressed K/V, and mlx-lm's 4-bit
quantized_matmul pair (group 64), for scale.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/compressed_attention_ops.py --tokens 8192 32768 --dtypes float32 bfloat16

`--check FILE` saves (or, when FILE exists, compares against) the outputs, so a change of the
implementation can be checked for equal results on the same inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import mlx.core as mx
import numpy as np

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.gear import GEARCache
from veloxquant_mlx.cache.kvquant import KVQuantCache

B, H, REP, D = 1, 8, 4, 128


def timed(fn, repeats):
    mx.eval(fn())
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        out.append((time.perf_counter() - t) * 1e3)
    return out


def build(method, tokens, dtype):
    mx.random.seed(1)
    k = mx.random.normal((B, H, tokens, D)).astype(dtype)
    v = mx.random.normal((B, H, tokens, D)).astype(dtype)
    cache = {"kvquant": KVQuantCache, "gear": GEARCache}[method](KVCacheConfig(method=method))
    cache.update_and_fetch(k, v)
    cache._flush()
    mx.eval(*cache.store.values())
    return cache, k, v


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--methods", nargs="+", default=["kvquant", "gear", "reference"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--check")
    ap.add_argument("--out")
    args = ap.parse_args()
    results, outputs = [], {}
    for tokens in args.tokens:
        for dname in args.dtypes:
            dtype = getattr(mx, dname)
            mx.random.seed(2)
            q = (mx.random.normal((B, H, REP, D)) * D**-0.5).astype(dtype)
            p = mx.softmax(mx.random.normal((B, H, REP, tokens)) * 3, axis=-1).astype(dtype)
            for method in args.methods:
                if method == "reference":
                    _, k, v = build("gear", tokens, dtype)
                    kq = mx.quantize(k, group_size=64, bits=4)
                    vq = mx.quantize(v, group_size=64, bits=4)
                    ops = {
                        "scores_dense": lambda: q @ k.swapaxes(-1, -2),
                        "values_dense": lambda: p @ v,
                        "scores_q4": lambda: mx.quantized_matmul(q, *kq, transpose=True, group_size=64, bits=4),
                        "values_q4": lambda: mx.quantized_matmul(p, *vq, transpose=False, group_size=64, bits=4),
                    }
                else:
                    cache, _, _ = build(method, tokens, dtype)
                    pc = mx.concatenate([p, mx.zeros((B, H, REP, cache.capacity - tokens), dtype)], -1)
                    ops = {"scores": lambda: cache._scores(q), "values": lambda: cache._weighted_values(pc)}
                for op, fn in ops.items():
                    ms = timed(fn, args.repeats)
                    key = f"{method}/{op}/{tokens}/{dname}"
                    outputs[key] = np.array(fn().astype(mx.float32))
                    row = dict(method=method, op=op, tokens=tokens, dtype=dname,
                               median_ms=statistics.median(ms), min_ms=min(ms), max_ms=max(ms))
                    results.append(row)
                    print(f"{key:40s} median {row['median_ms']:9.2f} ms  [{row['min_ms']:.2f}, {row['max_ms']:.2f}]",
                          flush=True)
    if args.check:
        if os.path.exists(args.check):
            saved = np.load(args.check)
            for key, a in outputs.items():
                if key in saved:
                    ref = saved[key]
                    err = np.abs(a - ref).max() / max(np.abs(ref).max(), 1e-30)
                    print(f"check {key:40s} max rel diff {err:.2e}")
        else:
            np.savez(args.check, **outputs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"load_avg": os.getloadavg(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
