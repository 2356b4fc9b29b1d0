"""Bytes held by TurboQuantRVQCache after a long prompt, against mlx-lm's fp16 KVCache and its
4-bit QuantizedKVCache, for SmolLM2-135M's KV shape (30 layers, 3 KV heads, head_dim 64) with
fp16 keys and values. Byte counts do not depend on the values, so the K/V are random.

  python scripts/bench_turboquant_rvq_bytes.py --context 4096 --out results/turboquant_rvq_bytes.json
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.turboquant_rvq import TurboQuantRVQCache

N_LAYERS, N_KV_HEADS, HEAD_DIM, N_Q_HEADS = 30, 3, 64, 9


def fill(cache, context, chunk=512):
    """Prefill in chunks, attending after each as a model would (our caches encode then)."""
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        k = mx.random.normal((1, N_KV_HEADS, n, HEAD_DIM)).astype(mx.float16)
        v = mx.random.normal((1, N_KV_HEADS, n, HEAD_DIM)).astype(mx.float16)
        cache.update_and_fetch(k, v)
        if isinstance(cache, TurboQuantRVQCache):
            # One query row is enough to run the flush that encodes the chunk.
            q = mx.random.normal((1, N_Q_HEADS, 1, HEAD_DIM)).astype(mx.float16)
            mx.eval(cache.attention(q, scale=0.125))
    mx.eval([a for a in vars(cache).values() if isinstance(a, mx.array)])
    return cache.nbytes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    per_layer = {
        "fp16_kvcache": fill(KVCache(), a.context),
        "mlx_quantized_4bit_g64": fill(QuantizedKVCache(group_size=64, bits=4), a.context),
    }
    bits_per_element = {}
    for bits in (1, 2, 3, 4):
        cache = TurboQuantRVQCache(KVCacheConfig(method="turboquant_rvq", bit_width_inlier=bits))
        per_layer[f"turboquant_rvq_{bits}"] = fill(cache, a.context)
        bits_per_element[f"turboquant_rvq_{bits}"] = {
            "accounting_bits_per_element": cache.bits_per_element(),
            "measured_store_bits_per_element": 8 * sum(x.nbytes for x in cache.store.values())
            / (2 * cache.capacity * N_KV_HEADS * HEAD_DIM),
            "exact_window_tokens": 0 if cache.window_keys is None else cache.window_keys.shape[2],
            "capacity_tokens": cache.capacity,
        }
    fp16 = per_layer["fp16_kvcache"]
    report = {
        "command": f"python scripts/bench_turboquant_rvq_bytes.py --context {a.context}",
        "shape": f"{N_LAYERS} layers x {N_KV_HEADS} kv heads x head_dim {HEAD_DIM}, fp16 K/V",
        "context": a.context,
        "bytes_all_layers": {k: v * N_LAYERS for k, v in per_layer.items()},
        "ratio_vs_fp16_kvcache": {k: round(v / fp16, 4) for k, v in per_layer.items()},
        "accounting": bits_per_element,
    }
    print(json.dumps(report, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
