"""One layer's kvquant `_encode` of a prompt chunk: CPU time, graph primitives, host syncs, traces.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m tests.cache.bench_kvquant_encode --rounds 7 --out results/kvquant_encode_cpu_s6.json

Shape by default: the 8B model's one layer (batch 1, 8 KV heads x 128), 2048-token chunks,
random K/V (test_encoder_identity's real-shaped data: offset and wide channels, a large sink,
value spikes), kvquant's defaults (3 bits, 1% outliers, group 32). `first` is a cache's first
chunk (sink and codebook fit), `later` any other. Per dtype and chunk kind:
  - cpu_ms: median / min / max of `_encode` plus its evaluation on the CPU (the MLX ops'
    path: the only one the CPU runs);
  - primitives: the lazy graph of one `_encode` (mx.export_to_dot), views left out (reshape,
    broadcast, slice, ...): `ops` the MLX ops' path as the CPU runs it (the codebook fit
    compiled), `cuda` the path MLX's CUDA backend takes (the codebook fit not compiled; our
    kernels on, each launch counted as one node through a stand-in for mx.fast.cuda_kernel:
    run in a tree without the kernels, as main before session 6, it is the eager ops'),
    with the count per primitive; a primitive is about one kernel launch on a GPU (a Compiled
    node is one fused kernel);
  - host_syncs: mx.eval / mx.async_eval calls made inside `_encode` (the code has no .item(),
    .tolist() or numpy conversion: read it);
  - traces: how many times the encoder's compiled functions were traced over `--chunks`
    chunks of the same size and a last one a token short of whole blocks, as mlx-lm's
    prefill makes them (first chunk, later chunks, last chunk);
  - whole later prefill chunk: the primitives and host syncs of the layer's whole chunk
    (update_and_fetch and the attention with 32 query heads, which decodes the history and
    encodes the chunk), for the encode's share of it.
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
from contextlib import contextmanager

import mlx.core as mx

from tests.cache.test_encoder_identity import _kv
from veloxquant_mlx import KVCacheConfig
from tests.cache import cuda_emulation
from tests.cache.bench_output import bench_header, emit
from veloxquant_mlx.cache import fused_decode, kvquant, nonuniform_codebook
from veloxquant_mlx.cache.kvquant import KVQuantCache

VIEW_PRIMITIVES = {"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Transpose", "AsStrided"}
STAND_IN = "StandInKernel"


def _cache_after(keys, values, first: bool) -> KVQuantCache:
    """A cache ready to `_encode` the chunk: fresh for `first`, else holding one chunk."""
    cache = KVQuantCache(KVCacheConfig(method="kvquant"))
    B, H, _, D = keys.shape
    cache.batch_size, cache.n_kv_heads, cache.head_dim, cache.value_dim, cache.dtype = B, H, D, D, keys.dtype
    if not first:
        cache.update_and_fetch(keys, values)
        cache._flush()
        mx.eval(cache.store)
    return cache


def cpu_ms(keys, values, first: bool, rounds: int) -> dict:
    seconds = []
    for i in range(rounds + 1):  # the first round warms up (traces, allocator)
        cache = _cache_after(keys, values, first)
        start = time.perf_counter()
        mx.eval(cache._encode(keys, values), cache.store)
        if i:
            seconds.append(time.perf_counter() - start)
    return {k: round(1e3 * f(seconds), 2) for k, f in (("median", statistics.median), ("min", min), ("max", max))}


@contextmanager
def _stand_in_kernels():
    """mx.fast.cuda_kernel replaced by a stand-in (nothing is computed): its outputs are zeros
    made to depend on its inputs (mx.depends), so the graph keeps everything the launch reads;
    `primitives` swaps those Full and Depends nodes for one node per launch. Yields the list
    of (kernel name, outputs) launched."""
    launches = []

    def build(name, input_names, output_names, source, header="", **_):
        def launch(*, inputs, output_shapes, output_dtypes, **__):
            launches.append((name, len(output_shapes)))
            outs = [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
            return mx.depends(outs, list(inputs))

        return launch

    builders = cuda_emulation.kernel_builders()  # every lru-cached kernel factory of our caches
    saved = mx.fast.cuda_kernel, fused_decode.kernels_enabled, nonuniform_codebook._fit_compiled
    for built in builders:
        built.cache_clear()
    # As on CUDA: the kernels on, the codebook fit not compiled (nonuniform_codebook._fit_compiled).
    mx.fast.cuda_kernel, fused_decode.kernels_enabled = build, (lambda: True)
    nonuniform_codebook._fit_compiled = lambda: False
    try:
        yield launches
    finally:
        mx.fast.cuda_kernel, fused_decode.kernels_enabled, nonuniform_codebook._fit_compiled = saved
        for built in builders:
            built.cache_clear()


def _graph(arrays) -> Counter:
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    nodes = Counter(re.findall(r'label ?= ?"([A-Za-z_]+)"', dot.getvalue()))
    return Counter({k: v for k, v in nodes.items() if k not in VIEW_PRIMITIVES})


def primitives(keys, values, first: bool, path: str) -> dict:
    cache = _cache_after(keys, values, first)
    stored_before = {k: id(v) for k, v in cache.store.items()}
    if path == "ops":
        out = cache._encode(keys, values)
        launches = []
    else:
        with _stand_in_kernels() as launches:
            out = cache._encode(keys, values)
    new_store = [v for k, v in cache.store.items() if stored_before.get(k) != id(v)]
    nodes = _graph(list(out.values()) + new_store)
    if launches:
        # The stand-in's zeros (one Full per kernel output) and its Depends nodes -> the launches.
        nodes["Full"] -= sum(outputs for _, outputs in launches)
        nodes.pop("Depends", None)
        for name, _ in launches:
            nodes[name] += 1
        nodes = +nodes  # drop zero counts
    return {"total": sum(nodes.values()), "by_primitive": dict(sorted(nodes.items()))}


def host_syncs(keys, values, first: bool, path: str) -> int:
    cache = _cache_after(keys, values, first)
    calls = []
    saved = mx.eval, mx.async_eval
    mx.eval = lambda *a, **k: calls.append("eval") or saved[0](*a, **k)
    mx.async_eval = lambda *a, **k: calls.append("async_eval") or saved[1](*a, **k)
    try:
        if path == "ops":
            cache._encode(keys, values)
        else:
            with _stand_in_kernels():
                cache._encode(keys, values)
    finally:
        mx.eval, mx.async_eval = saved
    return len(calls)


def traces(keys, values, chunks: int, path: str) -> list[int]:
    """Traces (calls of the Python functions mx.compile traces) per chunk: `chunks` whole
    chunks, then one a token short (mlx-lm's last prefill chunk); fresh compiled functions."""
    counts = Counter()
    wrapped = {}
    # Functions whose calls are traces (called by a compiled function's trace only); the codebook
    # fit's Lloyd iterations are compiled on the CPU only (eager on CUDA: calls, not traces).
    watched = [(kvquant, "select_outliers"), (kvquant, "outlier_ranking"), (kvquant, "nearest_level")]
    if path == "ops":
        watched.append((nonuniform_codebook, "_lloyd"))
    for module, name in watched:
        if not hasattr(module, name):
            continue
        original = getattr(module, name)
        wrapped[module, name] = original

        def counting(*a, _f=original, _n=name, **k):
            counts[_n] += 1
            return _f(*a, **k)

        setattr(module, name, counting)
    compiled = [getattr(kvquant, n, None) for n in ("_compiled_normalize", "_compiled_codes", "_ranking_function")]
    compiled = [f for f in compiled + [nonuniform_codebook._compiled_lloyd] if f is not None]
    for fn in compiled:
        fn.cache_clear()
    per_chunk = []
    try:
        cache = KVQuantCache(KVCacheConfig(method="kvquant"))
        n = keys.shape[2]
        sizes = [n] * chunks + [n - 1]
        with _stand_in_kernels() if path == "cuda" else _nothing():
            for i, size in enumerate(sizes):
                before = sum(counts.values())
                k, v = keys[:, :, :size], values[:, :, :size]
                cache.update_and_fetch(k, v)
                cache._flush()
                mx.eval(cache.store)
                per_chunk.append(sum(counts.values()) - before)
    finally:
        for (module, name), original in wrapped.items():
            setattr(module, name, original)
        for fn in compiled:
            fn.cache_clear()
    return per_chunk


def whole_chunk(keys, values, path: str, query_heads: int = 32) -> dict:
    """A layer's whole prefill chunk after the first (update_and_fetch, then the attention,
    which decodes the history and flushes the chunk through `_encode`): its graph's primitives
    and the host syncs (mx.eval / mx.async_eval) made while building it, to put the encode's
    share in context. `cuda`: our kernels on (each launch one node), as on MLX's CUDA backend."""
    cache = _cache_after(keys, values, first=False)
    B, H, n, D = keys.shape
    queries = mx.random.normal((B, query_heads, n, D)).astype(keys.dtype)
    with _stand_in_kernels() if path == "cuda" else _nothing() as launches:
        return chunk_counts(cache, keys, values, queries, launches)


def chunk_counts(cache, keys, values, queries, launches) -> dict:
    """One prefill chunk (update_and_fetch, then the causal attention) of `cache`, built inside
    a kernel stand-in context whose `launches` lists the kernels it recorded (empty off the
    kernel path): primitives (each launch one node, its stand-in's zeros and depends removed),
    host syncs made while building it, and the primitives by name. bench_gear_encode counts
    its chunk with it too."""
    mx.eval(queries)
    calls = []
    saved = mx.eval, mx.async_eval
    mx.eval = lambda *a, **k: calls.append("eval") or saved[0](*a, **k)
    mx.async_eval = lambda *a, **k: calls.append("async_eval") or saved[1](*a, **k)
    try:
        cache.update_and_fetch(keys, values)
        out = cache.attention(queries, scale=keys.shape[-1] ** -0.5, mask="causal")
    finally:
        mx.eval, mx.async_eval = saved
    nodes = _graph([out, *cache.store.values()])
    if launches:
        nodes["Full"] -= sum(outputs for _, outputs in launches)
        nodes.pop("Depends", None)
        for name, _ in launches:
            nodes[name] += 1
        nodes = +nodes
    return {"primitives": sum(nodes.values()), "host_syncs": len(calls), "by_primitive": dict(sorted(nodes.items()))}


@contextmanager
def _nothing():
    yield


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--chunks", type=int, default=3, help="whole chunks fed before the short one (traces)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    rows = {}
    load_before = os.getloadavg()
    for dtype_name in args.dtypes.split(","):
        keys, values = _kv(args.tokens, args.heads, args.dim, getattr(mx, dtype_name), seed=3, real_shaped=True)
        mx.eval(keys, values)
        for first in (True, False):
            case = f"{dtype_name} {'first' if first else 'later'} chunk"
            row = {"cpu_ms_ops": cpu_ms(keys, values, first, args.rounds)}
            for path in ("ops", "cuda"):
                row[f"primitives_{path}"] = primitives(keys, values, first, path)
                row[f"host_syncs_{path}"] = host_syncs(keys, values, first, path)
            rows[case] = row
            print(case, json.dumps(row), flush=True)
        for path in ("ops", "cuda"):
            rows[f"{dtype_name} traces per chunk ({path})"] = traces(keys, values, args.chunks, path)
            rows[f"{dtype_name} whole later prefill chunk ({path})"] = whole_chunk(keys, values, path)
    result = {
        **bench_header("tests.cache.bench_kvquant_encode", argv),
        "load_average_before_after": [load_before, os.getloadavg()],
        "settings": vars(args),
        "rows": rows,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
