"""One layer's decode step of TurboQuantRVQCache: update_and_fetch of one token, then the
compressed-form attention, timed against a baseline implementation of the same class (a module
file, e.g. an older commit's turboquant_rvq.py) and against mx.fast attention over the exact K/V,
in interleaved rounds (load on the machine hits every variant alike). Wall time and the process's
CPU time (time.process_time: all threads, and far less sensitive than wall time to other jobs on
a shared machine; run with OPENBLAS_NUM_THREADS=1 so BLAS threads do not spin) are both kept;
the ratio uses CPU time. Also the peak memory one step adds (mx.get_peak_memory), which shows
the sign stage's transient.

Shape: B=1, 8 kv heads, 32 query heads, head_dim 128 (an 8B-class llama layer).

  git show f28ee75:veloxquant_mlx/cache/turboquant_rvq.py > /tmp/tq_f28ee75.py
  OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
  python scripts/bench_turboquant_rvq_step.py --baseline /tmp/tq_f28ee75.py \
      --out results/turboquant_rvq_step_cpu.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import time

import mlx.core as mx

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.turboquant_rvq import TurboQuantRVQCache

KV_HEADS, Q_HEADS, HEAD_DIM = 8, 32, 128


def load_class(path: str):
    spec = importlib.util.spec_from_file_location("turboquant_rvq_baseline", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TurboQuantRVQCache


def filled(cls, tokens: int, dtype, bits: int):
    mx.random.seed(0)
    k = (mx.random.normal((1, KV_HEADS, tokens, HEAD_DIM)) + 1.0).astype(dtype)
    v = mx.random.normal((1, KV_HEADS, tokens, HEAD_DIM)).astype(dtype)
    cache = cls(KVCacheConfig(method="turboquant_rvq", bit_width_inlier=bits))
    cache.update_and_fetch(k, v)
    # Flush whole blocks through the compressed path (a 1-row attention: no prefill decode).
    mx.eval(cache.attention(mx.zeros((1, Q_HEADS, 1, HEAD_DIM), dtype), scale=HEAD_DIM**-0.5))
    mx.eval(*cache.store.values())
    return cache, k, v


def cache_step(cache, k1, v1, q):
    def step():
        cache.update_and_fetch(k1, v1)
        out = cache.attention(q, scale=HEAD_DIM**-0.5)
        mx.eval(out)
        cache.trim(1)  # back to the same length: every call sees the same cache

    return step


def exact_step(k, v, q):
    def step():
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=HEAD_DIM**-0.5))

    return step


def peak_added(step) -> int:
    mx.eval(mx.zeros(1))
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    step()
    return mx.get_peak_memory() - base


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--baseline", default=None, help="a turboquant_rvq.py to compare with")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3, help="calls averaged per round")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    classes = {"current": TurboQuantRVQCache}
    if a.baseline:
        classes["baseline"] = load_class(a.baseline)
    rows = []
    for tokens in a.tokens:
        for dtype_name in a.dtypes:
            dtype = getattr(mx, dtype_name)
            steps, peaks = {}, {}
            q = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM)).astype(dtype)
            k1 = mx.random.normal((1, KV_HEADS, 1, HEAD_DIM)).astype(dtype)
            v1 = mx.random.normal((1, KV_HEADS, 1, HEAD_DIM)).astype(dtype)
            for name, cls in classes.items():
                cache, k, v = filled(cls, tokens, dtype, a.bits)
                steps[name] = cache_step(cache, k1, v1, q)
                steps[name]()  # warm-up
                peaks[name] = peak_added(steps[name])
            # fp16-cache reference: fused attention over the exact K/V (GQA by repeat).
            k_rep, v_rep = mx.repeat(k, Q_HEADS // KV_HEADS, 1), mx.repeat(v, Q_HEADS // KV_HEADS, 1)
            mx.eval(k_rep, v_rep)
            steps["exact_sdpa"] = exact_step(k_rep, v_rep, q)
            steps["exact_sdpa"]()
            wall = {name: [] for name in steps}
            cpu = {name: [] for name in steps}
            for _ in range(a.rounds):
                for name, step in steps.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(a.calls):
                        step()
                    wall[name].append((time.perf_counter() - t0) / a.calls * 1e3)
                    cpu[name].append((time.process_time() - c0) / a.calls * 1e3)
            row = {"tokens": tokens, "dtype": dtype_name, "cpu_ms": {}, "wall_ms": {}, "peak_added_mb": {}}
            for key, times in (("cpu_ms", cpu), ("wall_ms", wall)):
                for name, ts in times.items():
                    row[key][name] = {
                        "median": round(statistics.median(ts), 2),
                        "min": round(min(ts), 2),
                        "max": round(max(ts), 2),
                    }
            for name, peak in peaks.items():
                row["peak_added_mb"][name] = round(peak / 2**20, 2)
            if "baseline" in cpu:
                row["current_over_baseline_cpu_median"] = round(
                    statistics.median(cpu["current"]) / statistics.median(cpu["baseline"]), 3
                )
            print(json.dumps(row), flush=True)
            rows.append(row)
            del steps
    report = {
        "command": "OPENBLAS_NUM_THREADS=1 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 python "
        "scripts/bench_turboquant_rvq_step.py " + (f"--baseline {a.baseline} " if a.baseline else "")
        + f"--tokens {' '.join(map(str, a.tokens))} --dtypes {' '.join(a.dtypes)} --bits {a.bits} "
        f"--rounds {a.rounds} --calls {a.calls}",
        "machine": f"{platform.machine()} CPU ({mx.default_device()}), MLX {mx.__version__}; "
        "2 cores shared with other jobs (noisy: compare within a row)",
        "shape": f"B=1, {KV_HEADS} kv heads, {Q_HEADS} query heads, head_dim {HEAD_DIM}, "
        f"turboquant_rvq-{a.bits}; one token per step",
        "rows": rows,
    }
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
