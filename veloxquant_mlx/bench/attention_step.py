"""One layer's decode-step attention, timed: fp16 mx.fast attention against our caches.

    python -m veloxquant_mlx.bench.attention_step --contexts 4096,32768,131072 --out FILE.json

Where a decode step's time goes, without the model around it: one layer (batch 1, 32 query /
8 KV heads, head_dim 128, bf16 by default, the Llama-3-8B attention shape), the history filled
with random K/V and compressed, then `cache.attention` of one query row per head timed call by
call (each call evaluated; median and spread over --calls calls after --warmup calls). The
reference is mx.fast.scaled_dot_product_attention over an fp16/bf16 K/V of the same length.
Each of our methods is timed twice where it has a fused kernel: kernel on, and
VELOXQUANT_CUDA_KERNELS=0 (the portable path). On the CPU only the portable path exists.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def _time_calls(fn, warmup: int, calls: int) -> dict:
    import mlx.core as mx

    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "n": calls}


def _filled_cache(method: str, context: int, k, v, params: dict):
    from veloxquant_mlx import KVCacheConfig, KVCacheFactory

    cache = KVCacheFactory.create(KVCacheConfig(method=method, **params), layer_index=0, n_layers=1)
    cache.update_and_fetch(k[:, :, :context], v[:, :, :context])
    # Encode the history as decode steps would have, without a prefill attention.
    cache._flush()
    return cache


def run(args) -> dict:
    import mlx.core as mx

    from veloxquant_mlx.bench import report
    from veloxquant_mlx.bench.methods import parse_specs
    from veloxquant_mlx.cache import fused_decode

    dtype = getattr(mx, args.dtype)
    H, Hq, D = args.kv_heads, args.heads, args.head_dim
    specs = [s for s in parse_specs(args.methods.split(",")) if s.kind == "ours"]
    result = {**report.header(), "settings": vars(args).copy(), "cases": []}
    for context in args.contexts:
        mx.random.seed(0)
        k = mx.random.normal((1, H, context, D)).astype(dtype)
        v = mx.random.normal((1, H, context, D)).astype(dtype)
        q = mx.random.normal((1, Hq, 1, D)).astype(dtype)
        mx.eval(k, v, q)
        scale = D**-0.5
        base = _time_calls(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
                           args.warmup, args.calls)
        result["cases"].append({"spec": "fp16-sdpa", "context": context, **base})
        print(f"{context:>7} fp16 sdpa {base['median_ms']:.3f} ms", flush=True)
        for spec in specs:
            params = {k_: v_ for k_, v_ in spec.params.items() if k_ != "method"}
            cache = _filled_cache(spec.params["method"], context, k, v, params)
            modes = ["portable"] + (["kernel"] if fused_decode._on_cuda() else [])
            for mode in modes:
                os.environ[fused_decode.ENV_SWITCH] = "1" if mode == "kernel" else "0"
                try:
                    timing = _time_calls(lambda: cache.attention(q, scale=scale), args.warmup, args.calls)
                except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                    timing = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                finally:
                    os.environ.pop(fused_decode.ENV_SWITCH, None)
                if "median_ms" in timing:
                    timing["ratio_vs_fp16_time"] = timing["median_ms"] / base["median_ms"]
                result["cases"].append({"spec": spec.name, "mode": mode, "context": context, **timing})
                shown = f"{timing['median_ms']:.3f} ms" if "median_ms" in timing else timing["error"]
                print(f"{context:>7} {spec.name} {mode}: {shown}", flush=True)
            del cache
        del k, v
        mx.clear_cache()
        report.write_json(result, args.out)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m veloxquant_mlx.bench.attention_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--contexts", type=lambda t: [int(x) for x in t.split(",")], default=[4096, 32768])
    p.add_argument("--methods", default="kivi,xquant")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--calls", type=int, default=20)
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
