"""Attention-output error of KVQuantCache vs mx.quantize (mlx-lm QuantizedKVCache's format) on
synthetic K/V with outlier channels, until the real-model harness is available.

Keys: N(0,1) plus fixed large offsets/scales on a few channels and rare spikes (the structure
KVQuant and KIVI report for real keys); values N(0,1). 16 queries per KV head attend over
`--tokens` tokens with logits of std ~2.5. Error = ||out - ref|| / ||ref||, ref in float32.

    python benchmarks/kvquant_synthetic.py --out results/kvquant_synthetic.json
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.kvquant import KVQuantCache


def data(T, D=64, H=3, seed=0):
    mx.random.seed(seed)
    offsets = mx.zeros((D,)).at[mx.array([3, 17, 40])].add(mx.array([12.0, -8.0, 6.0]))
    scales = mx.ones((D,)).at[mx.array([3, 17, 40, 55])].multiply(mx.array([4.0, 3.0, 5.0, 6.0]))
    k = mx.random.normal((1, H, T, D)) * scales + offsets
    k = mx.where(mx.random.uniform(shape=k.shape) < 0.002, k * 10, k)
    v = mx.random.normal((1, H, T, D))
    q = mx.random.normal((1, H * 4, 1, D)) / scales * 0.6
    return q, k, v


def attend(q, k, v):
    rep = q.shape[1] // k.shape[1]
    return mx.fast.scaled_dot_product_attention(q, mx.repeat(k, rep, 1), mx.repeat(v, rep, 1), scale=0.125)


def rel(a, b):
    return (mx.linalg.norm((a - b).reshape(-1)) / mx.linalg.norm(b.reshape(-1))).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = {}
    for seed in range(args.seeds):
        q, k, v = data(args.tokens, seed=seed)
        ref = attend(q, k, v)
        k16, v16 = k.astype(mx.float16), v.astype(mx.float16)
        for bits in (2, 3, 4):
            cache = KVQuantCache(KVCacheConfig(method="kvquant", kvquant_bits=bits))
            cache.update_and_fetch(k16, v16)
            cache._flush()
            out = cache.attention(q.astype(mx.float16), scale=0.125).astype(mx.float32)
            name = f"kvquant-{bits} g32 1% outliers ({cache.bits_per_element():.2f} bits/elem)"
            rows.setdefault(name, []).append(rel(out, ref))
            cache0 = KVQuantCache(KVCacheConfig(method="kvquant", kvquant_bits=bits, kvquant_outlier_fraction=0.0))
            cache0.update_and_fetch(k16, v16)
            cache0._flush()
            out = cache0.attention(q.astype(mx.float16), scale=0.125).astype(mx.float32)
            rows.setdefault(f"kvquant-{bits} g32 no outliers ({cache0.bits_per_element():.2f} bits/elem)", []).append(rel(out, ref))
        for bits, group in ((4, 64), (4, 32), (3, 64), (3, 32), (2, 32)):
            dq = [mx.dequantize(*mx.quantize(x, group_size=group, bits=bits), group_size=group, bits=bits)
                  for x in (k16, v16)]
            per = 32 // bits if bits != 3 else 32 / 3
            bpe = 32 / per + 32 / group
            rows.setdefault(f"mx.quantize per-token {bits}-bit g{group} ({bpe:.2f} bits/elem)", []).append(
                rel(attend(q, dq[0].astype(mx.float32), dq[1].astype(mx.float32)), ref))
    result = {
        "command": "python benchmarks/kvquant_synthetic.py " + " ".join(f"--{k} {v}" for k, v in vars(args).items() if v is not None),
        "what": "relative L2 error of one-token attention output vs float32, synthetic keys with outlier channels",
        "tokens": args.tokens,
        "relative_error_mean": {n: sum(e) / len(e) for n, e in rows.items()},
        "relative_error_per_seed": rows,
    }
    print(json.dumps(result["relative_error_mean"], indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
