"""Decode speed and bytes of TurboQuantRVQCache at a long context, against mlx-lm's fp16-layout
KVCache and its 4-bit QuantizedKVCache, in the same run, on a random-weight llama of
SmolLM2-135M's shape (speed does not depend on weight values).

Run (CPU, with OpenBLAS for fp32 matmul, see shared FACTS.md):
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
  python scripts/bench_turboquant_rvq_speed.py --context 4096 --out results/turboquant_rvq_speed.json

Until the integration's dispatcher lands, the model module's scaled_dot_product_attention is
wrapped here so our caches get their own attention (every other cache passes through).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.cache.turboquant_rvq import TurboQuantRVQCache

_original_sdpa = llama.scaled_dot_product_attention


def _dispatch(queries, keys, values, cache, scale, mask, sinks=None):
    if isinstance(cache, CompressedKVCache):
        return cache.attention(queries, scale=scale, mask=mask, sinks=sinks)
    return _original_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def smollm2_shaped_model(dtype=mx.float32) -> llama.Model:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
    )
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def prefill(model, cache, tokens, chunk=512):
    for start in range(0, tokens.shape[1], chunk):
        logits = model(tokens[:, start : start + chunk], cache=cache)
        mx.eval(logits)
    return logits


def decode_seconds(model, cache, token, steps):
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
    return (time.perf_counter() - t0) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    llama.scaled_dot_product_attention = _dispatch
    model = smollm2_shaped_model()
    n = len(model.layers)
    makers = {
        "fp16_kvcache": lambda: [KVCache() for _ in range(n)],
        "mlx_quantized_4bit_g64": lambda: [QuantizedKVCache(group_size=64, bits=4) for _ in range(n)],
        f"turboquant_rvq_{a.bits}": lambda: [
            TurboQuantRVQCache(KVCacheConfig(method="turboquant_rvq", bit_width_inlier=a.bits), i, n)
            for i in range(n)
        ],
    }
    tokens = mx.random.randint(0, 49152, (1, a.context))
    caches, nbytes = {}, {}
    for name, make in makers.items():
        cache = make()
        prefill(model, cache, tokens)
        caches[name] = cache
    for name, cache in caches.items():
        nbytes[name] = sum(c.nbytes for c in cache)
    token = tokens[:, -1:]
    times = {name: [] for name in caches}
    for _ in range(a.rounds):  # interleaved rounds: load on the machine hits every cache alike
        for name, cache in caches.items():
            times[name].append(decode_seconds(model, cache, token, a.steps))
            for c in cache:
                c.trim(a.steps)
    fp16_med = statistics.median(times["fp16_kvcache"])
    q4_med = statistics.median(times["mlx_quantized_4bit_g64"])
    report = {
        "command": "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python "
        f"scripts/bench_turboquant_rvq_speed.py --context {a.context} --steps {a.steps} --rounds {a.rounds} --bits {a.bits}",
        "machine": f"{platform.machine()} {platform.processor() or ''} CPU, MLX {mx.__version__}; shared by other jobs (noisy)",
        "model": "random-weight llama, SmolLM2-135M shape (30 layers, 9 q / 3 kv heads, head_dim 64), float32",
        "context": a.context,
        "results": {},
    }
    for name in caches:
        med = statistics.median(times[name])
        report["results"][name] = {
            "decode_tok_s_median": round(1 / med, 2),
            "decode_tok_s_min_max": [round(1 / max(times[name]), 2), round(1 / min(times[name]), 2)],
            "speed_vs_fp16_kvcache": round(fp16_med / med, 3),
            "speed_vs_mlx_quantized_4bit": round(q4_med / med, 3),
            "nbytes": nbytes[name],
        }
    report["note_bytes"] = (
        "nbytes here are of float32 K/V (the model runs in float32); bytes against an fp16 "
        "model are in turboquant_rvq_bytes.json"
    )
    print(json.dumps(report, indent=1))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
