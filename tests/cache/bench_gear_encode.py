"""One layer's gear `_encode` of a later prompt chunk and of a decode flush: primitives, host syncs, traces.

    python -m tests.cache.bench_gear_encode --out results/gear_encode_s6.json

Shape by default: the 8B model's one layer (batch 1, 8 KV heads x 128), a 2048-token prompt chunk
and a 256-token decode flush (one block), test_encoder_identity's real-shaped K/V, gear's
defaults (2 bits, group 32, rank 4, 1% outliers). Per dtype and size, the lazy graph of one
`_encode` after a first chunk (mx.export_to_dot, views left out: a primitive is about one
kernel launch on a GPU, a Compiled node one fused kernel), by primitive name, for three paths:
  - `cpu`: as the CPU runs it (the power iteration through mx.compile);
  - `cuda_ops`: as MLX's CUDA backend ran it before gear_encode_kernel.py (the power iteration
    uncompiled: gear_lowrank.COMPILE_ON_GPU; gear_encode_kernel.ENABLED = False);
  - `cuda_kernels`: the same with gear_encode_kernel's kernels on, each launch one node (through
    bench_kvquant_encode's stand-in for mx.fast.cuda_kernel, which computes nothing);
    `cuda_kernels_sum_per_column` with gear_encode_kernel.BATCHED_SUMS = False (these three with
    gear_power_kernel.ENABLED = False, as before session 17);
  - `cuda_power_kernel`: as MLX's CUDA backend runs it since session 17: the power iteration one
    launch per side (gear_power_kernel.py), the sparse part gear_encode_kernel's.
On the CPU mx.dequantize is built from elementwise ops where a GPU runs one kernel: at 2 bits 16
shift pairs, a concatenation and the multiply-add (fused under mx.compile into 16 Compiled...Shift
nodes, a Concatenate and a Compiled...MultiplyBroadcastAdd: 18 per dequantize, counted by
exporting one mx.dequantize's graph); `gpu_estimate` counts those as one per dequantize.
For a prompt chunk also the layer's whole later prefill chunk (append, history decode for the
attention with 32 query heads, encode at the flush; on CUDA the history by gear_prefill_kernel),
its primitives and host syncs. Also per path: host syncs (mx.eval / mx.async_eval calls inside `_encode`) and traces
(calls of the functions only mx.compile's traces call) per chunk over `--chunks` prompt chunks
then `--flushes` decode flushes of one cache.
"""

from __future__ import annotations

import argparse
from collections import Counter
from contextlib import contextmanager

import mlx.core as mx

from tests.cache.bench_kvquant_encode import _graph, _nothing, _stand_in_kernels, chunk_counts
from tests.cache.bench_output import bench_header, emit
from tests.cache.test_encoder_identity import _kv
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import gear_encode_kernel, gear_encoder, gear_lowrank, gear_power_kernel
from veloxquant_mlx.cache.gear import GEARCache

PATHS = ("cpu", "cuda_ops", "cuda_kernels", "cuda_kernels_sum_per_column", "cuda_power_kernel")
DEQUANTIZE_PER_ENCODE = 2  # keys and values: one mx.dequantize each
DEQUANTIZE_MULTIPLY_ADD = "CompiledAsTypeBroadcastMultiplyBroadcastAdd"  # its w * s + z on the CPU


@contextmanager
def _path(path: str):
    """The encode as `path` builds it (see the module docstring); yields the launches list."""
    saved = (gear_lowrank._compile_here, gear_encode_kernel.ENABLED, gear_encode_kernel.BATCHED_SUMS,
             gear_power_kernel.ENABLED)
    try:
        if path == "cpu":
            with _nothing():
                yield []
        else:
            gear_lowrank._compile_here = lambda: False
            gear_encode_kernel.ENABLED = path.startswith("cuda_kernels") or path == "cuda_power_kernel"
            gear_encode_kernel.BATCHED_SUMS = path == "cuda_kernels"
            gear_power_kernel.ENABLED = path == "cuda_power_kernel"
            with _stand_in_kernels() as launches:
                yield launches
    finally:
        (gear_lowrank._compile_here, gear_encode_kernel.ENABLED, gear_encode_kernel.BATCHED_SUMS,
         gear_power_kernel.ENABLED) = saved


def _primed(keys, values) -> GEARCache:
    cache = GEARCache(KVCacheConfig(method="gear"))
    cache.update_and_fetch(keys, values)
    cache._flush()
    mx.eval(cache.store)
    return cache


def primitives(cache: GEARCache, keys, values, path: str) -> dict:
    with _path(path) as launches:
        out = cache._encode(keys, values)
    nodes = _graph(list(out.values()))
    if launches:
        nodes["Full"] -= sum(outputs for _, outputs in launches)
        nodes.pop("Depends", None)
        for name, _ in launches:
            nodes[name] += 1
        nodes = +nodes
    shifts = sum(v for k, v in nodes.items() if k.startswith("Compiled") and "Shift" in k)
    # Each CPU dequantize: its shifts, one Concatenate and one fused multiply-add -> one kernel.
    assert nodes["Concatenate"] >= DEQUANTIZE_PER_ENCODE and nodes[DEQUANTIZE_MULTIPLY_ADD] == DEQUANTIZE_PER_ENCODE
    total = sum(nodes.values())
    return {
        "total": total,
        "gpu_estimate": total - shifts - 2 * DEQUANTIZE_PER_ENCODE + DEQUANTIZE_PER_ENCODE,
        "by_primitive": dict(sorted(nodes.items(), key=lambda kv: (-kv[1], kv[0]))),
    }


def whole_chunk(first: tuple, keys, values, path: str, query_heads: int = 32) -> dict:
    """The layer's whole later prefill chunk (update_and_fetch, then the attention: the history
    decode for mx.fast attention, the encode of the chunk at the flush) of a cache primed with
    `first` (K, V): primitives and host syncs, to put the encode's share in context."""
    cache = _primed(*first)
    B, H, n, D = keys.shape
    queries = mx.random.normal((B, query_heads, n, D), key=mx.random.key(1)).astype(keys.dtype)
    with _path(path) as launches:
        counts = chunk_counts(cache, keys, values, queries, launches)
    return {"primitives": counts["primitives"], "host_syncs": counts["host_syncs"]}


def host_syncs(cache: GEARCache, keys, values, path: str) -> int:
    calls = []
    saved = mx.eval, mx.async_eval
    with _path(path):
        mx.eval = lambda *a, **k: calls.append("eval") or saved[0](*a, **k)
        mx.async_eval = lambda *a, **k: calls.append("async_eval") or saved[1](*a, **k)
        try:
            cache._encode(keys, values)
        finally:
            mx.eval, mx.async_eval = saved
    return len(calls)


def traces(keys, values, chunks: int, flushes: int, path: str) -> list[int]:
    """Per `_flush` of one cache fed `chunks` prompt chunks then `flushes` decode flushes: calls
    of the functions only a trace of the compiled stages calls (fresh compiled functions)."""
    counts = Counter()
    watched = [(gear_encoder, "select_outliers"), (gear_encoder, "dequantize")]
    if path == "cpu":
        watched.append((gear_lowrank, "_power_iteration"))  # compiled on the CPU only
    originals = {}
    for module, name in watched:
        originals[module, name] = getattr(module, name)

        def counting(*a, _f=originals[module, name], _n=name, **k):
            counts[_n] += 1
            return _f(*a, **k)

        setattr(module, name, counting)
    compiled = [gear_encoder._compiled_quantize, gear_encoder._compiled_low_rank_parts,
                gear_encoder._compiled_sparse_part, gear_lowrank._compiled_iteration]
    for fn in compiled:
        fn.cache_clear()
    per_flush = []
    try:
        with _path(path):
            cache = GEARCache(KVCacheConfig(method="gear"))
            n, block = keys.shape[2], GEARCache.block_tokens
            sizes = [n] * chunks + [block] * flushes
            for size in sizes:
                before = sum(counts.values())
                cache.update_and_fetch(keys[:, :, :size], values[:, :, :size])
                cache._flush()
                mx.eval(cache.store)
                per_flush.append(sum(counts.values()) - before)
    finally:
        for (module, name), original in originals.items():
            setattr(module, name, original)
        for fn in compiled:
            fn.cache_clear()
    return per_flush


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--tokens", default="2048,256", help="chunk sizes: a prompt chunk, a decode flush")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--chunks", type=int, default=3)
    p.add_argument("--flushes", type=int, default=2)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    rows = {}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(mx, dtype_name)
        for tokens in (int(t) for t in args.tokens.split(",")):
            keys, values = _kv(2 * tokens, args.heads, args.dim, dtype, seed=2, real_shaped=True)
            first = tuple(a[:, :, :tokens] for a in (keys, values))
            later = (a[:, :, tokens:] for a in (keys, values))
            cache = _primed(*first)
            later_k, later_v = later
            mx.eval(later_k, later_v)
            row = {}
            for path in PATHS:
                row[path] = primitives(cache, later_k, later_v, path)
                row[path]["host_syncs"] = host_syncs(cache, later_k, later_v, path)
                if tokens > GEARCache.block_tokens:
                    row[path]["whole_later_prefill_chunk"] = whole_chunk(first, later_k, later_v, path)
            rows[f"{dtype_name} {tokens}-token later encode"] = row
            print(dtype_name, tokens, {p: (row[p]["total"], row[p]["gpu_estimate"]) for p in PATHS}, flush=True)
        keys, values = _kv(int(args.tokens.split(",")[0]), args.heads, args.dim, dtype, seed=2, real_shaped=True)
        for path in PATHS:
            rows[f"{dtype_name} traces per flush ({path})"] = traces(keys, values, args.chunks, args.flushes, path)
    result = {
        **bench_header("tests.cache.bench_gear_encode", argv),
        "settings": vars(args),
        "rows": rows,
    }
    emit(result, args.out)


if __name__ == "__main__":
    main()
