"""Decode speed and bytes of KVQuantCache (and, with --gear-bits, GEARCache) against mlx-lm's
KVCache and QuantizedKVCache-4.

Speed: a random-weight llama of SmolLM2-135M's shape in float32 on the CPU (weights do not change
speed), a `--context`-token prompt prefilled in chunks of 512, then `--steps` single-token decode
steps, each timed; every cache runs in the same process, interleaved round by round so machine
load hits them alike. Our cache's attention is the package's dispatcher
(veloxquant_mlx.integration.patch_model_kv_cache), installed once in the llama module. Bytes: 30 layers x 3 KV heads x head_dim 64 fed `--context` fp16 tokens, nbytes
against the fp16 KVCache.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
        python benchmarks/kvquant_speed.py --out results/kvquant_speed.json
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
from veloxquant_mlx.cache.kvquant import KVQuantCache
from veloxquant_mlx.integration import patch_model_kv_cache

SMOLLM2 = dict(
    model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
    vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
)


def install_dispatch(model):
    """The package's attention dispatcher (veloxquant_mlx.integration), installed in the llama
    module: CompressedKVCache instances get their own attention over the compressed form, every
    other cache goes to mlx-lm's function untouched."""
    patch_model_kv_cache(model, KVCacheConfig(method="kvquant"))


def gear_caches(bits, n_layers):
    from veloxquant_mlx.cache.gear import GEARCache

    config = KVCacheConfig(method="gear", gear_bits=bits)
    return [GEARCache(config, i, n_layers) for i in range(n_layers)]


def kvquant_caches(bits, n_layers):
    config = KVCacheConfig(method="kvquant", kvquant_bits=bits)
    return [KVQuantCache(config, i, n_layers) for i in range(n_layers)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bits", type=int, nargs="+", default=[3])
    ap.add_argument("--gear-bits", type=int, nargs="*", default=[], help="also time GEAR caches")
    ap.add_argument("--out")
    args = ap.parse_args()
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**SMOLLM2))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    install_dispatch(model)
    n = SMOLLM2["num_hidden_layers"]
    makers = {"fp16 KVCache (fp32 model)": lambda: [KVCache() for _ in range(n)],
              "mlx-lm QuantizedKVCache 4-bit g64": lambda: [QuantizedKVCache(64, 4) for _ in range(n)]}
    for b in args.bits:
        makers[f"kvquant-{b}"] = lambda b=b: kvquant_caches(b, n)
    for b in args.gear_bits:
        makers[f"gear-{b}"] = lambda b=b: gear_caches(b, n)
    prompt = mx.random.randint(0, SMOLLM2["vocab_size"], (1, args.context))
    caches = {}
    for name, make in makers.items():  # prefill every cache once
        cache = make()
        for s in range(0, args.context, 512):
            mx.eval(model(prompt[:, s : s + 512], cache=cache))
        caches[name] = cache
    times = {name: [] for name in makers}
    token = prompt[:, -1:]
    for _ in range(args.rounds):
        for name, cache in caches.items():
            for c in cache:  # decode steps only extend; trim back so every round sees the same length
                c.trim(c.offset - args.context) if c.offset > args.context else None
            mx.eval(model(token, cache=cache))  # warm-up step
            for _ in range(args.steps):
                t = time.perf_counter()
                mx.eval(model(token, cache=cache))
                times[name].append(time.perf_counter() - t)
    ref = statistics.median(times["fp16 KVCache (fp32 model)"])
    speed = {
        name: {
            "median_ms": 1e3 * statistics.median(ts),
            "p10_ms": 1e3 * sorted(ts)[len(ts) // 10],
            "p90_ms": 1e3 * sorted(ts)[9 * len(ts) // 10],
            "tokens_per_s": 1 / statistics.median(ts),
            "ratio_vs_fp16": ref / statistics.median(ts),
        }
        for name, ts in times.items()
    }
    fp16_bytes = 2 * n * 3 * args.context * 64 * 2
    memory = {}
    for b in args.bits:
        cache = kvquant_caches(b, n)
        for layer in cache:
            k = mx.random.normal((1, 3, args.context, 64)).astype(mx.float16)
            v = mx.random.normal((1, 3, args.context, 64)).astype(mx.float16)
            layer.update_and_fetch(k, v)
            layer._flush()
            mx.eval(list(layer.store.values()))
        nbytes = sum(c.nbytes for c in cache)
        accounted = cache[0].bits_per_element() / 16 * fp16_bytes
        memory[f"kvquant-{b}"] = {
            "nbytes": nbytes, "fp16_kvcache_bytes": fp16_bytes, "ratio_vs_fp16": nbytes / fp16_bytes,
            "bits_per_element": cache[0].bits_per_element(),
            "measured_over_accounted": nbytes / accounted,
        }
    result = {
        "command": "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 "
        "python benchmarks/kvquant_speed.py " + " ".join(
            f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items() if v is not None),
        "machine": f"{platform.machine()} {platform.processor() or ''} CPU, MLX {mx.__version__}, "
        "shared 2-core machine under load from other jobs (timings noisy)",
        "model": "random-weight llama, SmolLM2-135M shape, float32",
        "context": args.context,
        "decode_step": speed,
        "bytes_after_prompt": memory,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
