"""Time turboquant_rvq's `_encode` of a prefill chunk and its prefill decode
(`_prefill_keys_values`), the compiled ones against the frozen ones of main 714de0c
(turboquant_rvq_reference.py), interleaved round by round so that the load of a shared machine
falls on both alike.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m tests.cache.bench_turboquant_rvq_encoder --rounds 9

Shape by default: the 8B model's one layer (8 KV heads x 128), bf16, random K/V; `encode first`
is the cache's first 2048-token chunk (it also takes the key mean and the sink deltas), `encode
later` any other; `prefill decode` is one chunk's decode of a `--history`-token compressed
history into K/V (`--piece-mib` of float32 per piece, 16 by default, the cache's
prefill_decode_bytes: 4096 tokens each at this shape; each piece is one mx.eval, a sync on a
GPU, so a list such as 16,64,256 measures the syncs against the peak memory they bound).
Prints a JSON object: per case, median / min / max milliseconds for reference and current
(for `_encode` also current_uncompiled: the current code with mx.compile off), the order
rotating per round (and, for the prefill decode, the largest peak memory it added, result included), and the size
of each lazy
graph (mx.export_to_dot's nodes; "kernels" leaves out views, so it approximates the kernel
launches on a GPU, where mx.quantize / mx.dequantize are single kernels; on the CPU MLX builds
them from elementwise ops, which count here).
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
from tests.cache.turboquant_rvq_reference import ReferenceTurboQuantRVQCache
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import turboquant_rvq
from veloxquant_mlx.cache.turboquant_rvq import TurboQuantRVQCache

CLASSES = {"reference": ReferenceTurboQuantRVQCache, "current": TurboQuantRVQCache}
VIEW_PRIMITIVES = {"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Transpose", "AsStrided"}


def _ready_cache(cls, bits, keys, values, first: bool):
    """A cache set up as after its first update, holding one chunk already when not `first`,
    so that `_encode` can be called on its own."""
    cache = cls(KVCacheConfig(method="turboquant_rvq", bit_width_inlier=bits))
    B, H, _, D = keys.shape
    cache.batch_size, cache.n_kv_heads, cache.head_dim, cache.value_dim, cache.dtype = B, H, D, D, keys.dtype
    cache._setup()
    if not first:
        mx.eval(cache._encode(keys, values), cache.key_mean, cache.sink_deltas)
        cache.n_compressed = keys.shape[2]
    return cache


def time_encode(cls, bits, keys, values, first: bool, compiled: bool = True) -> float:
    """Seconds of one `_encode`; compiled False runs the current encoder's function uncompiled
    (the same ops as the reference, rebuilt: separates what mx.compile does from the code)."""
    cache = _ready_cache(cls, bits, keys, values, first)
    fusion_is_exact = turboquant_rvq._encoder_fusion_is_exact
    if not compiled:
        turboquant_rvq._encoder_fusion_is_exact = lambda *dims: False
    try:
        start = time.perf_counter()
        mx.eval(cache._encode(keys, values), cache.key_mean, cache.sink_deltas)
        return time.perf_counter() - start
    finally:
        turboquant_rvq._encoder_fusion_is_exact = fusion_is_exact


def encode_graph(cls, bits, keys, values, first: bool) -> dict:
    cache = _ready_cache(cls, bits, keys, values, first)
    arrays = list(cache._encode(keys, values).values()) + list(cache.sink_deltas or ())
    return _graph_size(arrays)


def _graph_size(arrays) -> dict:
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    nodes = Counter(re.findall(r'label ?= ?"([A-Za-z_]+)"', dot.getvalue()))
    kernels = {k: v for k, v in nodes.items() if k not in VIEW_PRIMITIVES}
    return {"nodes": sum(nodes.values()), "kernels": sum(kernels.values())}


def filled_cache(cls, bits, keys, values, history: int):
    """A cache whose store holds `history` compressed tokens (the chunk's K/V repeated)."""
    cache = cls(KVCacheConfig(method="turboquant_rvq", bit_width_inlier=bits))
    chunk = keys.shape[2]
    for _ in range(history // chunk):
        cache.update_and_fetch(keys, values)
        cache._flush()
        mx.eval(cache.store)
    return cache


def time_prefill_decode(cache, queries, peaks=None) -> float:
    """Seconds of one prefill decode; appends the peak memory it added (bytes over the active
    memory before it, its result included) to `peaks` when given."""
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    start = time.perf_counter()
    result = cache._prefill_keys_values(queries)
    mx.eval(*result)
    seconds = time.perf_counter() - start
    if peaks is not None:
        peaks.append(mx.get_peak_memory() - before)
    return seconds


def _row(seconds):
    return {
        label: {
            "median_ms": round(1e3 * statistics.median(s), 2),
            "min_ms": round(1e3 * min(s), 2),
            "max_ms": round(1e3 * max(s), 2),
        }
        for label, s in seconds.items()
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16")
    p.add_argument("--bits", default="4")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--history", type=int, default=16384, help="compressed tokens the prefill decode reads")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--piece-mib", default="16",
                   help="prefill_decode_bytes to time the prefill decode at (MiB of float32 per piece, comma list)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    rows = {}
    load_before = os.getloadavg()
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(mx, dtype_name)
        k1, k2 = mx.random.split(mx.random.key(7))
        shape = (1, args.heads, args.tokens, args.dim)
        keys = mx.random.normal(shape, key=k1).astype(dtype)
        values = mx.random.normal(shape, key=k2).astype(dtype)
        mx.eval(keys, values)
        for bits in (int(b) for b in args.bits.split(",")):
            for first in (True, False):
                case = f"encode {dtype_name} {bits}-bit {'first' if first else 'later'} chunk"
                runs = {  # label -> (class, compiled)
                    "reference": (CLASSES["reference"], True),
                    "current": (CLASSES["current"], True),
                    "current_uncompiled": (CLASSES["current"], False),
                }
                seconds = {label: [] for label in runs}
                for cls, compiled in runs.values():  # warm-up: traces, compiles, allocator
                    time_encode(cls, bits, keys, values, first, compiled)
                for r in range(args.rounds):
                    # The order rotates per round: whichever runs first after a cache is built
                    # measured a few ms faster on the CPU.
                    labels = list(runs)[r % 3 :] + list(runs)[: r % 3]
                    for label in labels:
                        seconds[label].append(time_encode(*runs[label][:1], bits, keys, values, first, runs[label][1]))
                rows[case] = _row(seconds)
                for label, cls in CLASSES.items():
                    rows[case][label]["graph"] = encode_graph(cls, bits, keys, values, first)
                _finish(rows, case)
            caches = {label: filled_cache(cls, bits, keys, values, args.history) for label, cls in CLASSES.items()}
            queries = mx.zeros((1, 4 * args.heads, args.tokens, args.dim), dtype)
            for mib in (float(m) for m in args.piece_mib.split(",")):
                case = f"prefill decode {dtype_name} {bits}-bit {args.history} history tokens, {mib:g} MiB pieces"
                for cache in caches.values():
                    cache.prefill_decode_bytes = int(mib * (1 << 20))
                    time_prefill_decode(cache, queries)
                seconds = {label: [] for label in CLASSES}
                peaks = {label: [] for label in CLASSES}
                for r in range(args.rounds):
                    for label in list(caches)[r % 2 :] + list(caches)[: r % 2]:
                        seconds[label].append(time_prefill_decode(caches[label], queries, peaks[label]))
                rows[case] = _row(seconds)
                rows[case]["compressed_tokens"] = caches["current"].n_compressed
                for label in CLASSES:
                    rows[case][label]["peak_added_mib_max"] = round(max(peaks[label]) / (1 << 20), 1)
                _finish(rows, case)
            # One 4096-token key piece's lazy graph (the prefill evaluates one piece at a time).
            cache = caches["current"]
            stop = min(cache.n_compressed, 4096)
            rows[f"prefill decode {dtype_name} {bits}-bit graph of a {stop}-token key piece"] = {
                "uncompiled": _graph_size([cache._decode_range(0, stop, "k")]),
                "compiled": _graph_size([cache._compiled_decode_range(0, stop, 0)]),
            }
    result = {
        **bench_header("tests.cache.bench_turboquant_rvq_encoder", argv),
        "load_average_before_after": [load_before, os.getloadavg()],
        "settings": vars(args),
        "rows": rows,
    }
    emit(result, args.out)


def _finish(rows, case):
    ref, cur = (rows[case][k]["median_ms"] for k in CLASSES)
    rows[case]["speedup_of_medians"] = round(ref / cur, 2)
    print(case, json.dumps(rows[case]), flush=True)


if __name__ == "__main__":
    main()
