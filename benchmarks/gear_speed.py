"""Decode speed and bytes of GEARCache at a long context, against mlx-lm's KVCache and
QuantizedKVCache in the same run, on a random-weight llama of SmolLM2-135M's shape.

Run (CPU, float32 model, OpenBLAS preloaded):
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
    /work/venv/bin/python benchmarks/gear_speed.py --context 4096 --out results/gear_speed.json

The prompt's K/V are computed once with the plain KVCache; every cache under test is filled
from the same per-layer K/V (GEAR encodes them exactly as a prefill would), then each decodes
the same tokens. Decode steps are timed one token at a time; medians and spread are reported.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.base import CompressedKVCache
from veloxquant_mlx.cache.gear import GEARCache
from veloxquant_mlx.integration.dispatch import install, module_names_of

SMOLLM2 = dict(
    model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
    vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
)


def fill(make, kv, dtype):
    caches = []
    for k, v in kv:
        c = make()
        c.update_and_fetch(k.astype(dtype), v.astype(dtype))
        if isinstance(c, CompressedKVCache):
            c._flush()
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches


def decode(model, caches, tokens):
    times = []
    for t in tokens:
        start = time.perf_counter()
        logits = model(mx.array([[t]]), cache=caches)
        mx.eval(logits)
        times.append(time.perf_counter() - start)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="results/gear_speed.json")
    args = ap.parse_args()

    load_at_start = os.getloadavg()
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(SMOLLM2))
    # The integration's dispatcher (veloxquant_mlx.integration): our caches attend over their
    # compressed form; mlx-lm's caches go to mlx-lm's attention untouched.
    install(module_names_of([layer.self_attn for layer in model.layers]))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    prompt = mx.random.randint(0, 49152, (1, args.context))

    start = time.perf_counter()
    ref = [KVCache() for _ in model.layers]
    for i in range(0, args.context, 1024):  # chunked like mlx-lm's prefill
        model(prompt[:, i : i + 1024], cache=ref)
        mx.eval([c.state for c in ref])
    prefill_s = time.perf_counter() - start
    kv = [(c.keys[:, :, : c.offset], c.values[:, :, : c.offset]) for c in ref]

    config = KVCacheConfig(method="gear", gear_bits=2)
    n_layers = len(model.layers)
    makers = {
        "fp16 KVCache": (KVCache, mx.float32),
        "QuantizedKVCache-4 g64": (lambda: QuantizedKVCache(group_size=64, bits=4), mx.float32),
        "gear-2": (lambda: GEARCache(config, 0, n_layers), mx.float32),
    }

    # Bytes: the same K/V as fp16 (an fp16 model's cache), all 30 layers.
    fp16_bytes = sum(fill(KVCache, kv, mx.float16)[i].nbytes for i in range(n_layers))
    start = time.perf_counter()
    gear16 = fill(lambda: GEARCache(config, 0, n_layers), kv, mx.float16)
    encode_s = time.perf_counter() - start
    gear_bytes = sum(c.nbytes for c in gear16)
    q4_bytes = sum(c.nbytes for c in fill(lambda: QuantizedKVCache(group_size=64, bits=4), kv, mx.float16))
    q2_bytes = sum(c.nbytes for c in fill(lambda: QuantizedKVCache(group_size=32, bits=2), kv, mx.float16))
    del gear16

    tokens = mx.random.randint(0, 49152, (args.steps,)).tolist()
    times = {name: [] for name in makers}
    for _ in range(args.rounds):  # interleaved rounds: load on the shared machine hits all alike
        for name, (make, dtype) in makers.items():
            caches = fill(make, kv, dtype)
            t = decode(model, caches, tokens)
            times[name].extend(t[2:])  # first steps warm up
            del caches
    tps = {name: 1.0 / statistics.median(t) for name, t in times.items()}
    spread = {
        name: [1.0 / max(t), 1.0 / min(t)] for name, t in times.items()
    }
    result = {
        "command": "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 "
        f"/work/venv/bin/python benchmarks/gear_speed.py --context {args.context} --steps {args.steps} "
        f"--rounds {args.rounds} --out {args.out}",
        "machine": f"{platform.machine()} {platform.processor() or ''} CPU, MLX {mx.__version__} "
        "cpu backend; 2 cores shared with other engineers' jobs (loaded, noisy)",
        "model": "random-weight llama, SmolLM2-135M shape (30 layers, 9 q / 3 kv heads, head_dim 64), float32",
        "load_average_start_end": [load_at_start, os.getloadavg()],
        "context": args.context,
        "gear_config": config.to_dict(),
        "decode_tokens_per_s_median": tps,
        "decode_tokens_per_s_min_max": spread,
        "decode_ratio_vs_fp16": {n: tps[n] / tps["fp16 KVCache"] for n in tps},
        "gear_vs_quantized4": tps["gear-2"] / tps["QuantizedKVCache-4 g64"],
        "prefill_s_fp32_kvcache": prefill_s,
        "gear_encode_s_all_layers": encode_s,
        "bytes_after_prompt": {
            "fp16 KVCache": fp16_bytes, "gear-2": gear_bytes,
            "QuantizedKVCache-4 g64": q4_bytes, "QuantizedKVCache-2 g32": q2_bytes,
        },
        "gear_bytes_ratio_vs_fp16": gear_bytes / fp16_bytes,
        "gear_bits_per_element_accounting": GEARCache.from_state(fill(lambda: GEARCache(config), kv[:1], mx.float16)[0].state).bits_per_element(),
    }
    print(json.dumps(result, indent=2))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
