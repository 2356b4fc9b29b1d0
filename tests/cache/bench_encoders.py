"""Time one layer's `_encode` of a prefill chunk, the current encoders against the frozen
references of main 2e28496 (encoder_reference.py), interleaved round by round so that the load
of a shared machine falls on both alike.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m tests.cache.bench_encoders --rounds 9

Shape by default: the 8B model's one layer (8 KV heads x 128), a 2048-token chunk, random K/V;
`first` is the cache's first chunk (kvquant also fits its codebooks then), `later` any other.
Prints a JSON object: per case, median / min / max milliseconds for reference and current, and
the size of each encoder's lazy graph for the chunk (mx.export_to_dot's nodes; "kernels" leaves
out views -- reshape, broadcast, slice, squeeze, expand_dims, transpose -- so it approximates the
kernel launches on a GPU, where mx.quantize / mx.dequantize are single kernels and on the CPU
MLX builds them from elementwise ops, which count here).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import statistics
import time
from collections import Counter

import mlx.core as mx

from tests.cache.bench_output import bench_header, emit
from tests.cache.encoder_reference import ReferenceGEARCache, ReferenceKVQuantCache
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import gear_lowrank
from veloxquant_mlx.cache.gear import GEARCache
from veloxquant_mlx.cache.kvquant import KVQuantCache

CLASSES = {"gear": (ReferenceGEARCache, GEARCache), "kvquant": (ReferenceKVQuantCache, KVQuantCache)}


def _ready_cache(cls, method, keys, values, first: bool):
    """A cache set up as after its first update (dtype, shape), holding one chunk already when
    not `first`, so that `_encode` can be called on its own."""
    cache = cls(KVCacheConfig(method=method))
    B, H, _, D = keys.shape
    cache.batch_size, cache.n_kv_heads, cache.head_dim, cache.value_dim, cache.dtype = B, H, D, D, keys.dtype
    if not first:
        mx.eval(cache._encode(keys, values), cache.store)
        cache.n_compressed = keys.shape[2]
    return cache


def time_encode(cls, method, keys, values, first: bool) -> float:
    cache = _ready_cache(cls, method, keys, values, first)
    start = time.perf_counter()
    mx.eval(cache._encode(keys, values), cache.store)
    return time.perf_counter() - start


VIEW_PRIMITIVES = {"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Transpose", "AsStrided"}


def graph_size(cls, method, keys, values, first: bool) -> dict:
    """Nodes of the lazy graph one `_encode` builds (the codebooks too on a first chunk)."""
    cache = _ready_cache(cls, method, keys, values, first)
    arrays = list(cache._encode(keys, values).values()) + list(cache.store.values())
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    nodes = Counter(re.findall(r'label ?= ?"([A-Za-z_]+)"', dot.getvalue()))
    kernels = {k: v for k, v in nodes.items() if k not in VIEW_PRIMITIVES}
    return {"nodes": sum(nodes.values()), "kernels": sum(kernels.values())}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="gear,kvquant")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    rows = {}
    load_before = os.getloadavg()
    for method in args.methods.split(","):
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(mx, dtype_name)
            k1, k2 = mx.random.split(mx.random.key(7))
            shape = (1, args.heads, args.tokens, args.dim)
            keys = mx.random.normal(shape, key=k1).astype(dtype)
            values = mx.random.normal(shape, key=k2).astype(dtype)
            mx.eval(keys, values)
            for first in (True, False) if method == "kvquant" else (True,):
                case = f"{method} {dtype_name} {'first' if first else 'later'} chunk"
                seconds = {"reference": [], "current": []}
                for cls in CLASSES[method]:  # warm-up: traces, compiles, allocator
                    time_encode(cls, method, keys, values, first)
                for _ in range(args.rounds):
                    for label, cls in zip(("reference", "current"), CLASSES[method]):
                        seconds[label].append(time_encode(cls, method, keys, values, first))
                rows[case] = {
                    label: {
                        "median_ms": round(1e3 * statistics.median(s), 2),
                        "min_ms": round(1e3 * min(s), 2),
                        "max_ms": round(1e3 * max(s), 2),
                    }
                    for label, s in seconds.items()
                }
                for label, cls in zip(("reference", "current"), CLASSES[method]):
                    rows[case][label]["graph"] = graph_size(cls, method, keys, values, first)
                if method == "gear":  # as on CUDA, where the power iteration is not compiled
                    compile_here, gear_lowrank._compile_here = gear_lowrank._compile_here, lambda: False
                    rows[case]["current"]["graph_power_iteration_uncompiled"] = graph_size(
                        CLASSES[method][1], method, keys, values, first
                    )
                    gear_lowrank._compile_here = compile_here
                ref, cur = (rows[case][k]["median_ms"] for k in ("reference", "current"))
                rows[case]["speedup_of_medians"] = round(ref / cur, 2)
                print(case, json.dumps(rows[case]), flush=True)
    result = {
        **bench_header("tests.cache.bench_encoders", argv),
        "load_average_before_after": [load_before, os.getloadavg()],
        "settings": vars(args),
        "rows": rows,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
