"""Where KVQuantCache's prefill spends its time per 2048-token chunk, on this machine.

    python -m tests.cache.bench_kvquant_prefill [--tokens 16384] [--dtypes bfloat16,float32]
        [--fills 3] [--out results/kvquant_prefill_cpu.json]
    python -m tests.cache.bench_kvquant_prefill --warmup [--method kivi] [--as-gpu]
        # fused kernels compiled on first use (a 2K prompt, then 8 decode steps)

One layer (batch 1, 8 kv heads, head_dim 128, kvquant defaults: 3 bits, group 32, 1% outliers),
the history filled in `--chunk`-token chunks as mlx-lm's generate does (the first chunk one
token short, so 31 tokens stay in the exact window as in bench.gpu_speed). Per chunk:
  - `history_ms`: CPU time of `_prefill_keys_values(queries)` evaluated (the decoded history +
    window the fused attention reads), `encode_ms`: of `_encode` of the window's whole blocks;
  - `*_nodes`: non-view nodes of the lazy graphs each builds (every graph handed to mx.eval
    inside the call plus the returned one; a node is about one kernel launch);
  - `*_syncs`: mx.eval calls inside the call (kvquant's modules hold no .item(), .tolist() or
    numpy conversion: read, not counted);
  - `*_traces`: Python traces of mx.compile'd functions during the call (a trace per new input
    shape; on CUDA a traced graph's fused kernels are JIT-compiled when first seen);
  - `*_kernels`: fused kernels compiled during the call (new files in MLX's CPU kernel cache,
    which this script points at a fresh TMPDIR): the CPU's analogue of the CUDA JIT compiles.
Medians over `--fills` fills; the first fill pays the compiles.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import statistics
import sys
import tempfile
import time
from collections import Counter

# A fresh kernel cache, so that compiled kernels are counted from zero (set before MLX starts).
if "VQ_KEEP_TMPDIR" not in os.environ:
    os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="vq_kvq_probe_")
    tempfile.tempdir = None

import mlx.core as mx  # noqa: E402

TRACES: Counter = Counter()
SYNCS = [0]
GRAPH_NODES = [0]
COUNT_GRAPHS = [False]
_compile, _eval = mx.compile, mx.eval
VIEW_PRIMITIVES = {"Broadcast", "Reshape", "ExpandDims", "Squeeze", "Slice", "Transpose", "AsStrided"}


def _counting_compile(fun, *args, **kwargs):
    name = getattr(fun, "__qualname__", repr(fun))

    def traced(*a, **k):
        TRACES[name] += 1
        return fun(*a, **k)

    return _compile(traced, *args, **kwargs)


def graph_nodes(*arrays) -> int:
    """Non-view nodes of the lazy graph reaching `arrays` (evaluated arrays count as inputs)."""
    flat = [a for a in _flatten(arrays) if isinstance(a, mx.array)]
    if not flat:
        return 0
    dot = io.StringIO()
    mx.export_to_dot(dot, *flat)
    nodes = Counter(re.findall(r'label ?= ?"([A-Za-z_]+)"', dot.getvalue()))
    return sum(v for k, v in nodes.items() if k not in VIEW_PRIMITIVES)


def _flatten(x):
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flatten(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _flatten(y)
    else:
        yield x


def _counting_eval(*args):
    SYNCS[0] += 1
    if COUNT_GRAPHS[0]:
        GRAPH_NODES[0] += graph_nodes(*args)
    return _eval(*args)


# Installed before veloxquant_mlx is imported: its modules call mx.compile at import or lazily.
mx.compile = _counting_compile
mx.eval = _counting_eval

from tests.cache.bench_output import bench_header, emit  # noqa: E402
from veloxquant_mlx.cache.kvquant import KVQuantCache  # noqa: E402
from veloxquant_mlx.config import KVCacheConfig  # noqa: E402

KERNEL_DIR = os.path.join(tempfile.gettempdir(), "mlx")
HQ, HK, D = 32, 8, 128


def kernel_names() -> set[str]:
    """Fused kernels built so far, without the CPU's contiguous / strided_N variant suffix: a
    GPU JIT-compiles one module per such name (its variants inside)."""
    return {re.sub(r"_(contiguous|strided_\d+)\.so$", "", f)
            for _, _, files in os.walk(KERNEL_DIR) for f in files if f.endswith(".so")}


def kernel_files() -> int:
    return sum(f.endswith(".so") for _, _, files in os.walk(KERNEL_DIR) for f in files)


def measured(fn):
    """fn() evaluated -> (ms, syncs, traces, kernels, nodes, result)."""
    s0, t0, k0 = SYNCS[0], Counter(TRACES), kernel_files()
    GRAPH_NODES[0] = 0
    COUNT_GRAPHS[0] = True
    # Node counting walks the graph (not timed work); count on a first pass, time a second.
    out = fn()
    nodes = GRAPH_NODES[0] + graph_nodes(out)
    COUNT_GRAPHS[0] = False
    _eval(out)
    syncs = SYNCS[0] - s0
    traces = dict(TRACES - t0)
    kernels = kernel_files() - k0
    return syncs, traces, kernels, nodes, out


def timed(fn) -> float:
    start = time.perf_counter()
    _eval(fn())
    return (time.perf_counter() - start) * 1e3


def fill(cache, k, v, q, chunk: int, detail: bool) -> list[dict]:
    rows = []
    n = k.shape[2]
    s0 = 0
    while n - s0 > 1:
        step = min(chunk, n - s0 - 1)
        part = slice(s0, s0 + step)
        cache.update_and_fetch(k[:, :, part], v[:, :, part])
        queries = q[:, :, part]
        row = {"history_tokens": cache.n_compressed}
        if cache.n_compressed:
            if detail:
                row["history_syncs"], row["history_traces"], row["history_kernels"], row["history_nodes"], _ = measured(
                    lambda: cache._prefill_keys_values(queries))
            row["history_ms"] = timed(lambda: cache._prefill_keys_values(queries))
        # The chunk's attention itself (mx.fast over the history, what fp16's cache pays too)
        # is left out: on the CPU its bf16 score products would take minutes per chunk.
        wn = cache.window_keys.shape[2]
        nb = (wn // cache.block_size) * cache.block_size
        wk, wv = cache.window_keys[:, :, :nb], cache.window_values[:, :, :nb]
        if cache.n_compressed and detail:
            row["encode_syncs"], row["encode_traces"], row["encode_kernels"], row["encode_nodes"], _ = measured(
                lambda: cache._encode(wk, wv))
        if cache.n_compressed:
            row["encode_ms"] = timed(lambda: cache._encode(wk, wv))
        else:  # the first chunk's encode also stores the sink and fits the codebooks: once
            start = time.perf_counter()
            k0, t0 = kernel_files(), sum(TRACES.values())
            enc = cache._encode(wk, wv)
            _eval(enc, cache.store)
            row["encode_ms"] = (time.perf_counter() - start) * 1e3
            row["encode_traces"], row["encode_kernels"] = sum(TRACES.values()) - t0, kernel_files() - k0
            cache._append_compressed(enc, nb)
            _eval(cache.store, cache.window_keys, cache.window_values)
            rows.append(row)
            s0 += step
            continue
        cache._append_compressed(cache._encode(wk, wv), nb)
        _eval(cache.store, cache.window_keys, cache.window_values)
        rows.append(row)
        s0 += step
    return rows


def summarize(fills: list[list[dict]]) -> list[dict]:
    out = []
    for i, first in enumerate(fills[0]):
        row = {k: v for k, v in first.items() if not k.endswith("_ms")}
        for key in ("history_ms", "encode_ms"):
            vals = [f[i][key] for f in fills[1:] if key in f[i]] or [first[key]] if key in first else []
            if vals:
                row[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}
        if "history_ms" in first:
            row["history_ms_first_fill"] = first["history_ms"]
        row["encode_ms_first_fill"] = first["encode_ms"]
        out.append(row)
    return out


def prefill_probe(tokens: int, chunk: int, dtypes, n_fills: int) -> dict:
    out = {}
    for name in dtypes:
        dtype = getattr(mx, name)
        mx.random.seed(1)
        k = mx.random.normal((1, HK, tokens, D)).astype(dtype)
        v = mx.random.normal((1, HK, tokens, D)).astype(dtype)
        q = mx.random.normal((1, HQ, tokens, D)).astype(dtype)
        _eval(k, v, q)
        fills = []
        for i in range(n_fills):
            cache = KVQuantCache(KVCacheConfig(method="kvquant"))
            fills.append(fill(cache, k, v, q, chunk, detail=(i == 0)))
            print(f"{name} fill {i}: " + " ".join(
                f"{r['history_tokens']}:{r.get('history_ms', 0):.0f}/{r['encode_ms']:.0f}" for r in fills[-1]),
                file=sys.stderr, flush=True)
        out[name] = summarize(fills)
    return out


def warmup_probe(method: str, tokens: int = 2048, steps: int = 8) -> dict:
    """Distinct compiles of a first use: a `tokens` prompt (one chunk, last token held back) and
    `steps` decode steps through the cache's own attention. Off CUDA a decode step takes the
    portable compiled path (scores/values functions), on CUDA the fused kernel instead, so the
    decode part is listed apart."""
    from veloxquant_mlx.cache.registry import cache_class

    dtype = mx.bfloat16
    mx.random.seed(3)
    k = mx.random.normal((1, HK, tokens + steps, D)).astype(dtype)
    q = mx.random.normal((1, HQ, tokens + steps, D)).astype(dtype)
    cache = cache_class(method)(KVCacheConfig(method=method))
    res = {}
    TRACES.clear()
    k0, names0 = kernel_files(), kernel_names()
    start = time.perf_counter()
    part = slice(0, tokens - 1)
    cache.update_and_fetch(k[:, :, part], k[:, :, part])
    _eval(cache.attention(q[:, :, part], scale=D**-0.5, mask="causal"), cache.store)
    res["prefill"] = {"traces": dict(TRACES), "kernels": kernel_files() - k0,
                      "distinct_kernels": len(kernel_names() - names0), "s": time.perf_counter() - start}
    TRACES.clear()
    k0, names0 = kernel_files(), kernel_names()
    start = time.perf_counter()
    for t in range(tokens - 1, tokens - 1 + steps):
        cache.update_and_fetch(k[:, :, t : t + 1], k[:, :, t : t + 1])
        _eval(cache.attention(q[:, :, t : t + 1], scale=D**-0.5), cache.store)
    res["decode_steps"] = {"traces": dict(TRACES), "kernels": kernel_files() - k0,
                           "distinct_kernels": len(kernel_names() - names0), "s": time.perf_counter() - start}
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--fills", type=int, default=3)
    p.add_argument("--warmup", action="store_true")
    p.add_argument("--method", default="kvquant")
    p.add_argument("--as-gpu", action="store_true",
                   help="take kvquant's off-CPU choices (eager codebook fit, eager prefill pieces) "
                        "to count the fused kernels a GPU would JIT on first use")
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.as_gpu:
        from veloxquant_mlx.cache import kvquant, nonuniform_codebook

        nonuniform_codebook._fit_compiled = lambda: False
        kvquant._prefill_fusion_is_exact = lambda: False
    if args.warmup:
        result = {"warmup": {args.method: warmup_probe(args.method)}}
    else:
        result = {"tokens": args.tokens, "chunk": args.chunk, "fills": args.fills,
                  "per_chunk": prefill_probe(args.tokens, args.chunk, args.dtypes.split(","), args.fills)}
    result.update(bench_header("tests.cache.bench_kvquant_prefill", argv), load_average=os.getloadavg())
    emit(result, args.out)


if __name__ == "__main__":
    main()
