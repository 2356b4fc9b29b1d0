"""KIVI against mlx-lm's caches: bytes after a prompt, decode speed, peak memory of a long
prefill. Writes results/kivi_<part>.json.

    python scripts/bench_kivi.py bytes
    python scripts/bench_kivi.py decode --context 4096 --steps 32 --rounds 5
    python scripts/bench_kivi.py peak --context 16384 --layers 4
    python scripts/bench_kivi.py attention --rounds 40

The model is a random-weight mlx-lm llama of SmolLM2-135M's shape (30 layers, 9 query heads,
3 KV heads, head_dim 64, hidden 576) in float32: speed and memory do not depend on weight values.
On Linux the script re-executes itself with Debian's OpenBLAS preloaded when it exists (fp32
matmul ~30x faster than MLX's bundled reference BLAS; shared/FACTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
if os.path.exists(OPENBLAS) and OPENBLAS not in os.environ.get("LD_PRELOAD", ""):
    os.environ["LD_PRELOAD"] = OPENBLAS
    os.execv(sys.executable, [sys.executable, *sys.argv])

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import KVCache, QuantizedKVCache  # noqa: E402

from veloxquant_mlx import KVCacheBuilder, KVCacheConfig, patch_model_kv_cache, unpatch_model_kv_cache  # noqa: E402

SMOLLM2 = dict(
    model_type="llama", hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
    vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True,
)


def machine() -> dict:
    return {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "load_average": os.getloadavg(), "mlx": mx.__version__,
        "device": str(mx.default_device()), "openblas_preloaded": OPENBLAS in os.environ.get("LD_PRELOAD", ""),
        "note": "2 CPU cores shared with other engineers' jobs: timings are noisy, see spread",
    }


def kivi_config(bits: int) -> KVCacheConfig:
    return KVCacheConfig(method="kivi", bit_width_inlier=bits)


def write(name: str, payload: dict) -> None:
    payload = {"command": "python scripts/bench_kivi.py " + " ".join(sys.argv[1:]), "machine": machine(), **payload}
    path = os.path.join(os.path.dirname(__file__), "..", "results", f"kivi_{name}.json")
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
    print(json.dumps(payload, indent=2))


# ---- bytes -------------------------------------------------------------------------------------
def run_bytes(args) -> None:
    """Bytes held after a prompt, fp16 K/V of SmolLM2's shape, fed straight into the caches."""
    n_layers, H, D, T = 30, 3, 64, args.context
    makers = {
        "fp16 KVCache": lambda i: KVCache(),
        "mlx-lm QuantizedKVCache 4-bit g64": lambda i: QuantizedKVCache(group_size=64, bits=4),
        "mlx-lm QuantizedKVCache 2-bit g32": lambda i: QuantizedKVCache(group_size=32, bits=2),
    }
    out = {}
    for name in ("fp16 KVCache", "mlx-lm QuantizedKVCache 4-bit g64", "mlx-lm QuantizedKVCache 2-bit g32", "kivi-2", "kivi-4"):
        mx.random.seed(0)
        mx.clear_cache()
        before = mx.get_active_memory()
        caches = []
        for layer in range(n_layers):
            if name.startswith("kivi"):
                from veloxquant_mlx import KVCacheFactory
                cache = KVCacheFactory.create(kivi_config(int(name[-1])), layer, n_layers)
            else:
                cache = makers[name](layer)
            k = (mx.random.normal((1, H, T, D)) * 2).astype(mx.float16)
            v = mx.random.normal((1, H, T, D)).astype(mx.float16)
            cache.update_and_fetch(k, v)
            if name.startswith("kivi"):
                cache.attention(mx.zeros((1, 9, 1, D), mx.float16), scale=1.0)  # encode the prompt
            mx.eval([c.state for c in [cache]])
            del k, v
            caches.append(cache)
        mx.eval([c.state for c in caches])
        mx.clear_cache()
        grown = mx.get_active_memory() - before
        nbytes = sum(c.nbytes for c in caches)
        out[name] = {"nbytes": nbytes, "active_memory_growth": grown}
        if name.startswith("kivi"):
            out[name]["bits_per_element_compressed"] = caches[0].bits_per_element()
        del caches
    fp16 = out["fp16 KVCache"]["nbytes"]
    for entry in out.values():
        entry["ratio_vs_fp16"] = round(entry["nbytes"] / fp16, 4)
        entry["active_growth_ratio_vs_fp16_nbytes"] = round(entry["active_memory_growth"] / fp16, 4)
    write("bytes", {"context": T, "shape": "30 layers x 3 KV heads x head_dim 64, fp16 K/V",
                    "target": "kivi-2 <= 0.23x fp16", "results": out})


# ---- decode speed --------------------------------------------------------------------------------
def random_model(n_layers: int):
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**{**SMOLLM2, "num_hidden_layers": n_layers}))
    mx.eval(model.parameters())
    return model


def prefill(model, cache, n_tokens: int, chunk: int = 2048):
    tokens = mx.random.randint(0, SMOLLM2["vocab_size"], (n_tokens,))
    for start in range(0, n_tokens, chunk):
        model(tokens[start : start + chunk][None], cache=cache)
        mx.eval([c.state for c in cache])


def time_decode(model, cache, steps: int) -> list[float]:
    token = mx.array([[1]])
    per_token = []
    for _ in range(steps):
        t0 = time.perf_counter()
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
        per_token.append(time.perf_counter() - t0)
    return per_token


def run_decode(args) -> None:
    model = random_model(args.layers)
    n_layers = args.layers
    configs = {
        "fp16 KVCache": lambda: [KVCache() for _ in range(n_layers)],
        "mlx-lm QuantizedKVCache 4-bit g64": lambda: [QuantizedKVCache(group_size=64, bits=4) for _ in range(n_layers)],
        "kivi-2": lambda: patch_model_kv_cache(model, kivi_config(2)),
        # patched once (the dispatcher); further configs built against the same patch
        "kivi-4": lambda: KVCacheBuilder.for_model(model, kivi_config(4)),
    }
    # One real prefill (fp16 KVCache); the other caches take the same K/V directly (decode speed
    # does not depend on how the history got there, and prefills are slow on a loaded CPU).
    reference = configs["fp16 KVCache"]()
    prefill(model, reference, args.context)
    caches = {"fp16 KVCache": reference}
    for name, make in list(configs.items())[1:]:
        cache = make()
        for layer_cache, source in zip(cache, reference):
            keys, values = source.state[0][:, :, : source.offset], source.state[1][:, :, : source.offset]
            layer_cache.update_and_fetch(keys, values)
            if hasattr(layer_cache, "attention"):  # our caches encode on their next attention
                layer_cache.attention(mx.zeros((1, 9, 1, keys.shape[-1]), keys.dtype), scale=1.0)
        mx.eval([c.state for c in cache])
        caches[name] = cache
    times = {name: [] for name in configs}
    # Interleaved rounds: the machine's load drifts; every cache sees the same drift.
    for _ in range(args.rounds):
        for name, cache in caches.items():
            time_decode(model, cache, 2)  # warm-up, also re-primes the dispatcher's flag
            times[name].extend(time_decode(model, cache, args.steps))
            for c in cache:  # back to the same context for the next round
                c.trim(args.steps + 2)
    unpatch_model_kv_cache(model)
    results = {}
    fp16_median = statistics.median(times["fp16 KVCache"])
    q4_median = statistics.median(times["mlx-lm QuantizedKVCache 4-bit g64"])
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=4)
        med = statistics.median(ts)
        results[name] = {
            "median_tokens_per_s": round(1 / med, 2), "median_ms_per_token": round(1e3 * med, 2),
            "p25_ms": round(1e3 * q[0], 2), "p75_ms": round(1e3 * q[2], 2),
            "speed_ratio_vs_fp16": round(fp16_median / med, 3),
            "speed_ratio_vs_mlx_lm_q4": round(q4_median / med, 3), "samples": len(ts),
        }
    write("decode", {"context": args.context, "layers": n_layers, "model": "random-weight llama, SmolLM2-135M shape, float32",
                     "target": "kivi >= 0.8x fp16 KVCache and >= mlx-lm QuantizedKVCache 4-bit", "results": results})


# ---- peak memory of a long prefill -----------------------------------------------------------------
def run_peak(args) -> None:
    model = random_model(args.layers)
    out = {}
    for name in args.caches.split(","):
        if name == "fp16":
            cache = [KVCache() for _ in range(args.layers)]
        else:
            cache = patch_model_kv_cache(model, kivi_config(int(name.split("-")[1])))
        mx.eval(mx.zeros(1))
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        t0 = time.perf_counter()
        prefill(model, cache, args.context, args.chunk)
        seconds = time.perf_counter() - t0
        out[name] = {
            "peak_memory_above_weights": mx.get_peak_memory() - base,
            "cache_nbytes": sum(c.nbytes for c in cache), "prefill_seconds": round(seconds, 1),
        }
        unpatch_model_kv_cache(model)
        del cache
    if "fp16" in out:
        for entry in out.values():
            entry["peak_ratio_vs_fp16"] = round(entry["peak_memory_above_weights"] / out["fp16"]["peak_memory_above_weights"], 3)
    write("peak", {"context": args.context, "chunk": args.chunk, "layers": args.layers,
                   "model": "random-weight llama, SmolLM2-135M shape (fewer layers), float32",
                   "target": "peak with kivi <= peak with fp16 KVCache", "results": out})


# ---- one layer's decode attention ---------------------------------------------------------------
def run_attention(args) -> None:
    """One layer's decode attention at `context` (9 query / 3 KV heads, head_dim 64, float32),
    interleaved rounds; the minimum is the least load-disturbed figure on a shared CPU."""
    from mlx_lm.models.base import quantized_scaled_dot_product_attention

    from veloxquant_mlx import KVCacheFactory

    T = args.context
    mx.random.seed(0)
    k, v = mx.random.normal((1, 3, T, 64)), mx.random.normal((1, 3, T, 64))
    q = mx.random.normal((1, 9, 1, 64))
    kivi = {}
    for bits in (2, 4):
        cache = KVCacheFactory.create(kivi_config(bits))
        cache.update_and_fetch(k, v)
        cache.attention(q, scale=0.125)
        cache.update_and_fetch(k[:, :, :1], v[:, :, :1])
        kivi[bits] = cache
    qk, qv = mx.quantize(k, group_size=64, bits=4), mx.quantize(v, group_size=64, bits=4)
    mx.eval(qk, qv, [c.state for c in kivi.values()])
    functions = {
        "fp16 KVCache path (mx.fast.scaled_dot_product_attention)": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125),
        "mlx-lm QuantizedKVCache 4-bit g64 path": lambda: quantized_scaled_dot_product_attention(q, qk, qv, scale=0.125, mask=None, group_size=64, bits=4),
        "kivi-2 compressed attention": lambda: kivi[2]._attend(q, 0.125, None, 3, kivi[2].offset - 1),
        "kivi-4 compressed attention": lambda: kivi[4]._attend(q, 0.125, None, 3, kivi[4].offset - 1),
    }
    times = {name: [] for name in functions}
    for _ in range(args.rounds):
        for name, f in functions.items():
            t0 = time.perf_counter()
            mx.eval(f())
            times[name].append(time.perf_counter() - t0)
    results = {name: {"min_us": round(1e6 * min(ts), 1), "median_us": round(1e6 * statistics.median(ts), 1)} for name, ts in times.items()}
    write("attention", {"context": T, "rounds": args.rounds, "results": results})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("part", choices=["bytes", "decode", "peak", "attention"])
    parser.add_argument("--context", type=int, default=None)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--caches", default="fp16,kivi-2")
    args = parser.parse_args()
    if args.context is None:
        args.context = {"bytes": 4096, "decode": 4096, "peak": 16384, "attention": 4096}[args.part]
    {"bytes": run_bytes, "decode": run_decode, "peak": run_peak, "attention": run_attention}[args.part](args)


if __name__ == "__main__":
    main()
