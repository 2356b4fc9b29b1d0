"""One layer's decode-step attention products over the compressed form, timed per op, A/B.

For KVQuantCache and GEARCache: `_scores(q)` and `_weighted_values(p)` of one decode step
(B=1, 8 KV heads, 32 query heads folded into 4 rows per KV head, head_dim 128), each evaluated
on its own. With `--baseline REF`, the same ops of the cache classes as of git REF run on the
same store (the state is handed over; the layouts must match) and the two are interleaved
repeat by repeat, so machine load hits both alike; the largest relative difference of their
outputs is printed too. `--reference` adds the uncompressed products (q @ K^T, p @ V in the
input dtype) and mlx-lm's 4-bit quantized_matmul pair (group 64) for scale.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 PYTHONPATH=. \\
        python benchmarks/compressed_attention_ops.py --baseline f28ee75 --tokens 8192 32768 \\
        --dtypes float32 bfloat16 --repeats 9 --reference --out /tmp/ops_ab.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import mlx.core as mx

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.gear import GEARCache
from veloxquant_mlx.cache.kvquant import KVQuantCache

B, H, REP, D = 1, 8, 4, 128
CLASSES = {"kvquant": KVQuantCache, "gear": GEARCache}
# The modules whose code decides these ops, per method (the baseline copies them from git).
MODULES = {
    "kvquant": ["kvquant", "kvquant_attention", "nonuniform_codebook", "sparse_outliers"],
    "gear": ["gear", "gear_attention", "gear_outliers", "gear_lowrank", "split_reduction"],
}


def baseline_class(method: str, ref: str):
    """The method's cache class as of git `ref`, imported under a private package name."""
    root = tempfile.mkdtemp(prefix="baseline_")
    package = f"baseline_{method}"
    os.makedirs(os.path.join(root, package))
    open(os.path.join(root, package, "__init__.py"), "w").close()
    for name in MODULES[method]:
        try:
            text = subprocess.run(
                ["git", "show", f"{ref}:veloxquant_mlx/cache/{name}.py"], check=True, capture_output=True, text=True
            ).stdout
        except subprocess.CalledProcessError:
            continue  # a module that did not exist yet at ref
        for other in MODULES[method]:
            text = text.replace(f"veloxquant_mlx.cache.{other} ", f"{package}.{other} ")
            text = text.replace(f"veloxquant_mlx.cache.{other}\n", f"{package}.{other}\n")
        with open(os.path.join(root, package, f"{name}.py"), "w") as f:
            f.write(text)
    sys.path.insert(0, root)
    module = importlib.import_module(f"{package}.{method}")
    return getattr(module, CLASSES[method].__name__)


def build(method: str, tokens: int, dtype):
    mx.random.seed(1)
    k = mx.random.normal((B, H, tokens, D)).astype(dtype)
    v = mx.random.normal((B, H, tokens, D)).astype(dtype)
    cache = CLASSES[method](KVCacheConfig(method=method))
    cache.update_and_fetch(k, v)
    cache._flush()
    mx.eval(*cache.store.values())
    return cache, k, v


def interleaved(fns: dict, repeats: int) -> dict:
    for fn in fns.values():
        mx.eval(fn())  # warm-up (and compile)
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            mx.eval(fn())
            times[name].append((time.perf_counter() - t) * 1e3)
    return times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--methods", nargs="+", default=["kvquant", "gear"])
    ap.add_argument("--baseline", help="git ref whose cache code runs beside the current one")
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out")
    args = ap.parse_args()
    baselines = {m: baseline_class(m, args.baseline) for m in args.methods} if args.baseline else {}
    rows = []
    for tokens in args.tokens:
        for dname in args.dtypes:
            dtype = getattr(mx, dname)
            mx.random.seed(2)
            q = (mx.random.normal((B, H, REP, D)) * D**-0.5).astype(dtype)
            for method in args.methods:
                cache, k, v = build(method, tokens, dtype)
                caches = {"current": cache}
                if method in baselines:
                    caches["baseline"] = baselines[method].from_state(cache.state)
                p = mx.softmax(mx.random.normal((B, H, REP, cache.capacity)) * 3, axis=-1).astype(dtype)
                for op in ("scores", "values"):
                    fns = {
                        name: (lambda c=c: c._scores(q)) if op == "scores" else (lambda c=c: c._weighted_values(p))
                        for name, c in caches.items()
                    }
                    times = interleaved(fns, args.repeats)
                    row = {"method": method, "op": op, "tokens": tokens, "dtype": dname,
                           "load_avg_1m": os.getloadavg()[0]}
                    for name, t in times.items():
                        row[name] = {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t)}
                    if "baseline" in fns:
                        a = fns["baseline"]().astype(mx.float32)[..., :tokens]
                        b = fns["current"]().astype(mx.float32)[..., :tokens]
                        row["max_rel_diff"] = (mx.abs(a - b).max() / mx.abs(a).max()).item()
                        row["speedup_median"] = row["baseline"]["median_ms"] / row["current"]["median_ms"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                if args.reference and method == args.methods[0]:
                    kq = mx.quantize(k, group_size=64, bits=4)
                    vq = mx.quantize(v, group_size=64, bits=4)
                    pt = p[..., :tokens]
                    ref = {
                        "scores_uncompressed": lambda: q @ k.swapaxes(-1, -2),
                        "values_uncompressed": lambda: pt @ v,
                        "scores_mlx_q4": lambda: mx.quantized_matmul(q, *kq, transpose=True, group_size=64, bits=4),
                        "values_mlx_q4": lambda: mx.quantized_matmul(pt, *vq, transpose=False, group_size=64, bits=4),
                    }
                    for name, t in interleaved(ref, args.repeats).items():
                        row = {"method": "reference", "op": name, "tokens": tokens, "dtype": dname,
                               "load_avg_1m": os.getloadavg()[0],
                               "current": {"median_ms": statistics.median(t), "min_ms": min(t), "max_ms": max(t)}}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "baseline": args.baseline, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
