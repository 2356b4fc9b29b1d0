"""Where one GEAR layer's prefill chunk spends its time, and whether it stays free of host syncs
and per-chunk retraces; also a fast test that keeps it that way.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m tests.cache.test_gear_prefill_probe --tokens 16384 --dtypes bfloat16,float32

One layer (batch 1, 8 kv heads, head_dim 128: the 8B model's layer), the policy's gear setting
(2 bits, group 32, rank 4, 1% outliers), history filled in 2048-token chunks as mlx-lm's prefill
does. Per chunk, for the two pieces a prefill chunk adds to the fused attention:
  * `prefill_kv`: `_prefill_keys_values(queries)` (the history decoded + the window, what the
    fused attention reads), and
  * `encode`: `_encode` of the chunk's blocks (what `_flush` writes into the store),
it prints the CPU milliseconds to build and evaluate each, the primitives of the lazy graph each
builds before evaluation (mx.export_to_dot's labelled nodes: on a GPU roughly one kernel launch
each, views aside), the host syncs each makes (calls of mx.eval / mx.async_eval /
array.item / array.tolist during the build; numpy conversions: none in the gear modules, by
reading), and the mx.compile traces each triggers (a new input shape retraces; on CUDA a
retrace also JIT-compiles its fused kernels).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import os
import re
import statistics
import sys
import time
from types import SimpleNamespace

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache import gear, gear_attention, gear_encoder, gear_lowrank
from veloxquant_mlx.cache.gear import GEARCache

HEADS, DIM = 8, 128
VIEW_PRIMITIVES = {"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Transpose", "AsStrided"}


class Counters:
    """Host syncs and mx.compile traces while active (see the module docstring)."""

    def __init__(self):
        self.syncs = 0
        self.traces = 0
        # Graph built before a sync and evaluated by it (a piecewise decode evaluates its pieces
        # as it goes: the graph left at the end is only the last piece's).
        self.synced_graph = {"nodes": 0, "kernels": 0}

    @contextlib.contextmanager
    def active(self):
        saved_eval, saved_async = mx.eval, mx.async_eval
        saved_item, saved_tolist = mx.array.item, mx.array.tolist

        def counted(fn, evaluates=False):
            def wrapper(*args, **kwargs):
                self.syncs += 1
                if evaluates:
                    for key, count in graph_nodes(*_arrays_in(args)).items():
                        self.synced_graph[key] += count
                return fn(*args, **kwargs)

            return wrapper

        mx.eval, mx.async_eval = counted(saved_eval, True), counted(saved_async, True)
        mx.array.item, mx.array.tolist = counted(saved_item), counted(saved_tolist)
        try:
            yield self
        finally:
            mx.eval, mx.async_eval = saved_eval, saved_async
            mx.array.item, mx.array.tolist = saved_item, saved_tolist


def _arrays_in(tree) -> list:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [a for item in tree for a in _arrays_in(item)]
    return []


# Every lru_cache'd factory of a compiled function the gear modules hold; cleared so that the
# compiled functions are made again through the tracing wrapper below.
def _compiled_factories():
    found = []
    for module in (gear, gear_attention, gear_encoder, gear_lowrank):
        for value in vars(module).values():
            if callable(getattr(value, "cache_clear", None)) and value is not gear_lowrank._start_matrix:
                found.append(value)
    return found


@contextlib.contextmanager
def counting_traces(counters: Counters):
    """mx.compile wrapped so each trace of a compiled function's Python body counts once."""
    real_compile = mx.compile

    def compile_counting(fn, *args, **kwargs):
        def traced(*a, **k):
            counters.traces += 1
            return fn(*a, **k)

        return real_compile(traced, *args, **kwargs)

    for factory in _compiled_factories():
        factory.cache_clear()
    mx.compile = compile_counting
    try:
        yield
    finally:
        mx.compile = real_compile
        for factory in _compiled_factories():
            factory.cache_clear()


def graph_nodes(*arrays) -> dict:
    """Primitives of the lazy graph reaching `arrays` (evaluated inputs are not counted)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    labels = re.findall(r'label ?= ?"([^"]+)"', dot.getvalue())
    return {"nodes": len(labels), "kernels": sum(1 for x in labels if x not in VIEW_PRIMITIVES)}


def _measure(counters: Counters, build):
    """(ms to build, ms to evaluate, graph, syncs and traces during the build, outputs)."""
    syncs, traces, synced = counters.syncs, counters.traces, dict(counters.synced_graph)
    start = time.perf_counter()
    with counters.active():
        outputs = build()
    built = time.perf_counter()
    arrays = list(outputs.values()) if isinstance(outputs, dict) else list(outputs)
    graph = graph_nodes(*arrays)
    for key in graph:  # what the syncs during the build evaluated counts too
        graph[key] += counters.synced_graph[key] - synced[key]
    traces_built = counters.traces
    evaluated = time.perf_counter()
    mx.eval(arrays)
    done = time.perf_counter()
    return {
        "build_ms": 1e3 * (built - start),
        "eval_ms": 1e3 * (done - evaluated),
        "ms": 1e3 * (built - start + done - evaluated),
        **graph,
        "syncs": counters.syncs - syncs,
        # Traces happen when a compiled function is first called with a shape (the build) or,
        # for MLX's lazy compile, at evaluation; both count.
        "traces": counters.traces - traces,
        "traces_in_build": traces_built - traces,
    }, outputs


def fill_and_probe(dtype, tokens: int, chunk: int = 2048, piece_tokens: int | None = None,
                   unsynced_tokens: int | None = None, seed: int = 3, with_reference: bool = False):
    """Per chunk: the two pieces' figures (the first chunk has no history to decode).
    `piece_tokens`, `unsynced_tokens`: the prefill decode's piece length and the history up to
    which it makes no sync of its own (default: the cache's own settings). `with_reference`:
    also `prefill_kv_before`, main 68a76e1's path (the base class's one-graph decode, frozen in
    test_gear_prefill.py), measured right before the current one on the same history."""
    from tests.cache.test_gear_prefill import reference_prefill_keys_values

    cache = GEARCache(KVCacheConfig(method="gear", gear_bits=2, gear_rank=4, gear_outlier_fraction=0.01))
    if piece_tokens is not None and hasattr(cache, "prefill_decode_bytes"):
        cache.prefill_decode_bytes = HEADS * DIM * 4 * piece_tokens
    if unsynced_tokens is not None and hasattr(cache, "prefill_unsynced_bytes"):
        cache.prefill_unsynced_bytes = HEADS * DIM * 4 * unsynced_tokens
    cache._dispatcher = SimpleNamespace(installed=True)  # as under the integration's patch
    counters = Counters()
    rows = []
    key = mx.random.key(seed)
    with counting_traces(counters):
        for start in range(0, tokens, chunk):
            key, k1, k2, k3 = mx.random.split(key, 4)
            keys = mx.random.normal((1, HEADS, chunk, DIM), key=k1).astype(dtype)
            values = mx.random.normal((1, HEADS, chunk, DIM), key=k2).astype(dtype)
            queries = mx.random.normal((1, 4 * HEADS, chunk, DIM), key=k3).astype(dtype)
            mx.eval(keys, values, queries)
            cache.update_and_fetch(keys, values)
            row = {"history": cache.n_compressed}
            if cache.n_compressed and with_reference:
                row["prefill_kv_before"], _ = _measure(counters, lambda: reference_prefill_keys_values(cache, queries))
            if cache.n_compressed:
                row["prefill_kv"], _ = _measure(counters, lambda: cache._prefill_keys_values(queries))
            n = cache._window_length()
            window = (cache.window_keys[:, :, :n], cache.window_values[:, :, :n])
            row["encode"], encoded = _measure(counters, lambda: cache._encode(*window))
            cache._append_compressed(encoded, n)
            mx.eval(list(cache.store.values()))
            rows.append(row)
    return rows


def _rounded(figures: dict) -> dict:
    return {k: round(v, 2) for k, v in figures.items()}


def _summary(rows, piece: str) -> dict:
    values = [r[piece] for r in rows if piece in r]
    ms = [v["ms"] for v in values]
    return {
        "ms_median": round(statistics.median(ms), 2), "ms_min": round(min(ms), 2), "ms_max": round(max(ms), 2),
        "nodes_per_chunk": [v["nodes"] for v in values],
        "kernels_per_chunk": [v["kernels"] for v in values],
        "syncs_per_chunk": [v["syncs"] for v in values],
        "traces_per_chunk": [v["traces"] for v in values],
    }


def compare_paths(dtype, tokens: int, rounds: int = 5, chunk: int = 2048) -> dict:
    """One more chunk's `_prefill_keys_values` over a `tokens` history, main 68a76e1's path (the
    base class's: the whole history decoded in one graph, frozen in test_gear_prefill.py;
    "before"), session 5's (GEARCache's 32 MiB pieces ordered by host syncs,
    gear.PREFILL_HOST_SYNCS; "host_syncs") and GEARCache's own ("after"), interleaved round by round: CPU ms and the peak memory each adds over its
    start (ratio to the fp16 K/V of the history + window), and whether they agree bit for bit."""
    from tests.cache.test_gear_prefill import reference_prefill_keys_values

    cache = GEARCache(KVCacheConfig(method="gear", gear_bits=2, gear_rank=4, gear_outlier_fraction=0.01))
    cache._dispatcher = SimpleNamespace(installed=True)
    for _ in range(tokens // chunk + 1):
        keys = mx.random.normal((1, HEADS, chunk, DIM)).astype(dtype)
        cache.update_and_fetch(keys, keys)
        if cache._window_length() > chunk:
            cache._flush()
        mx.eval(list(cache.store.values()), cache.window_keys)
    queries = mx.random.normal((1, 4 * HEADS, chunk, DIM)).astype(dtype)
    mx.eval(queries)
    def with_host_syncs():  # session 5's path: 32 MiB pieces ordered by host syncs
        saved = gear.PREFILL_HOST_SYNCS, cache.prefill_decode_bytes
        gear.PREFILL_HOST_SYNCS, cache.prefill_decode_bytes = True, 32 << 20
        try:
            return cache._prefill_keys_values(queries)
        finally:
            gear.PREFILL_HOST_SYNCS, cache.prefill_decode_bytes = saved

    paths = {"before": lambda: reference_prefill_keys_values(cache, queries),
             "host_syncs": with_host_syncs,
             "after": lambda: cache._prefill_keys_values(queries)}
    held = cache.n_compressed + cache._window_length()
    fp16 = 2 * held * HEADS * DIM * 2
    out = {"history": cache.n_compressed, "window": cache._window_length(), "fp16_kv_mib": round(fp16 / 2**20, 1)}
    results = {}
    for name, build in paths.items():  # warm-up (traces), graph and peak
        mx.eval(build())
        counters = Counters()
        with counters.active():
            built = build()
        out[name] = graph_nodes(*built)
        for key in out[name]:  # pieces evaluated during the build count too
            out[name][key] += counters.synced_graph[key]
        out[name]["syncs"] = counters.syncs
        mx.eval(built)
        built = None
        gc.collect()
        mx.clear_cache()
        start = mx.get_active_memory()
        mx.reset_peak_memory()
        results[name] = build()
        mx.eval(results[name])
        peak = mx.get_peak_memory() - start
        out[name].update(peak_added_mib=round(peak / 2**20, 1), peak_over_fp16_kv=round(peak / fp16, 2), ms=[])
    out["bit_identical"] = all(
        mx.array_equal(a.view(mx.uint16 if a.dtype.size == 2 else mx.uint32),
                       b.view(mx.uint16 if b.dtype.size == 2 else mx.uint32)).item()
        for other in ("host_syncs", "after") for a, b in zip(results["before"], results[other]))
    results = None
    for _ in range(rounds):
        for name, build in paths.items():
            t0 = time.perf_counter()
            mx.eval(build())
            out[name]["ms"].append(round(1e3 * (time.perf_counter() - t0), 1))
    for name in paths:
        ms = out[name]["ms"]
        out[name].update(ms_median=statistics.median(ms), ms_min=min(ms), ms_max=max(ms))
    return out


def per_chunk_ab(dtype, tokens: int, chunk: int = 2048) -> dict:
    """Per chunk of one layer's fill, session 5's prefill K/V build (host syncs, 32 MiB pieces:
    "s5_host_syncs_32MiB") and session 6's (no host sync, gear.PREFILL_PIECE_BYTES pieces:
    "s6_ordered"), measured one right after the other on the same history (which goes first
    alternates by chunk), then the chunk's encode; the probe's figures for each."""
    cache = GEARCache(KVCacheConfig(method="gear", gear_bits=2, gear_rank=4, gear_outlier_fraction=0.01))
    cache._dispatcher = SimpleNamespace(installed=True)
    variants = {"s5_host_syncs_32MiB": (True, 32 << 20), "s6_ordered": (False, None)}
    counters = Counters()
    rows = []
    key = mx.random.key(3)
    with counting_traces(counters):
        for i, start in enumerate(range(0, tokens, chunk)):
            key, k1, k2, k3 = mx.random.split(key, 4)
            keys = mx.random.normal((1, HEADS, chunk, DIM), key=k1).astype(dtype)
            values = mx.random.normal((1, HEADS, chunk, DIM), key=k2).astype(dtype)
            queries = mx.random.normal((1, 4 * HEADS, chunk, DIM), key=k3).astype(dtype)
            mx.eval(keys, values, queries)
            cache.update_and_fetch(keys, values)
            row = {"history": cache.n_compressed}
            for name in (list(variants) if i % 2 else list(variants)[::-1]) if cache.n_compressed else []:
                saved = gear.PREFILL_HOST_SYNCS
                gear.PREFILL_HOST_SYNCS, cache.prefill_decode_bytes = variants[name]
                try:
                    row[name], _ = _measure(counters, lambda: cache._prefill_keys_values(queries))
                finally:
                    gear.PREFILL_HOST_SYNCS, cache.prefill_decode_bytes = saved, None
            n = cache._window_length()
            window = (cache.window_keys[:, :, :n], cache.window_values[:, :, :n])
            row["encode"], encoded = _measure(counters, lambda: cache._encode(*window))
            cache._append_compressed(encoded, n)
            mx.eval(list(cache.store.values()))
            rows.append(row)
    summary = {name: _summary(rows[1:], name) for name in (*variants, "encode")}
    return {"per_chunk": [{"history": r["history"], **{k: _rounded(r[k]) for k in r if k != "history"}} for r in rows],
            **summary}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--compare", default="", help="histories (tokens, comma-separated) at which to "
                   "compare the base path's prefill K/V with GEARCache's: ms, peak memory, bits")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--with-reference", action="store_true",
                   help="per chunk, also time main 68a76e1's prefill K/V build (prefill_kv_before)")
    p.add_argument("--ab-syncs", action="store_true",
                   help="per chunk, session 5's prefill K/V build (host syncs, 32 MiB pieces) against session "
                        "6's (no sync), alternately on the same history, instead of the plain probe")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    result = {"load_average_before": os.getloadavg(), "cases": {}, "compare": {}}
    for name in args.dtypes.split(",") if args.compare else []:
        for tokens in map(int, args.compare.split(",")):
            row = compare_paths(getattr(mx, name), tokens, args.rounds, args.chunk)
            result["compare"][f"{name} {tokens}"] = row
            print(name, tokens, json.dumps(row), flush=True)
    if args.tokens <= 0:
        args.dtypes = ""
    if args.ab_syncs:
        for name in [d for d in args.dtypes.split(",") if d]:
            case = per_chunk_ab(getattr(mx, name), args.tokens, args.chunk)
            result["ab_syncs"] = {**result.get("ab_syncs", {}), name: case}
            print(name, json.dumps({k: v for k, v in case.items() if k != "per_chunk"}), flush=True)
        args.dtypes = ""
    for name in [d for d in args.dtypes.split(",") if d]:
        rows = fill_and_probe(getattr(mx, name), args.tokens, args.chunk, with_reference=args.with_reference)
        case = {
            "per_chunk": [
                {"history": r["history"], **{k: _rounded(r[k]) for k in r if k != "history"}} for r in rows
            ],
            **({"prefill_kv_before": _summary(rows, "prefill_kv_before")} if args.with_reference else {}),
            "prefill_kv": _summary(rows, "prefill_kv"),
            "encode": _summary(rows, "encode"),
        }
        result["cases"][name] = case
        print(name, json.dumps({k: v for k, v in case.items() if k != "per_chunk"}), flush=True)
    result["load_average_after"] = os.getloadavg()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


# ---- the fast test: what the probe measured stays so --------------------------------------------
@pytest.mark.parametrize("synced", [False, True])
@pytest.mark.parametrize("host_syncs", [False, True])
def test_a_prefill_chunk_syncs_only_as_set_and_never_traces_again(monkeypatch, synced, host_syncs):
    # 6 chunks of 512 tokens (history 512..2560), pieces of 1024: from the fourth chunk on
    # every piece shape has been seen, so no compiled function traces again. Encoding never
    # syncs; the prefill decode makes no sync of its own (session 6: its order is made by
    # mx.depends, gear._prefill_order) unless gear.PREFILL_HOST_SYNCS restores session 5's:
    # the queries' evaluation, and once the history passes `unsynced_tokens`, one per piece
    # but the last.
    monkeypatch.setattr(gear, "PREFILL_HOST_SYNCS", host_syncs)
    synced = synced and host_syncs
    rows = fill_and_probe(mx.bfloat16, 6 * 512, chunk=512, piece_tokens=1024, unsynced_tokens=1024 if synced else 4096)
    for row in rows[-2:]:
        assert row["encode"]["syncs"] == 0 and row["encode"]["traces"] == 0, row
        assert row["prefill_kv"]["traces"] == 0, row
        pieces = -(-row["history"] // 1024)
        expected = (1 + (2 * pieces - 1 if synced else 0)) if host_syncs else 0
        assert row["prefill_kv"]["syncs"] == expected, row


if __name__ == "__main__":
    sys.exit(main())
