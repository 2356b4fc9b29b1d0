"""One prefill chunk of a pair of layers, per method: time, graph size and host syncs.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python -m tests.cache.bench_pair_prefill --methods kivi,xquant,minicache --history 16384

Why: on the H200 (session 6, 8B-shaped llama, 32K prompt in 2048-token chunks) xquant prefilled
at 1.43x and minicache at 1.41x the fp16 cache's time against kivi's 1.19x. This replays what one
chunk does in two consecutive layers of a model (xquant's leader / follower, minicache's lower /
upper pair, kivi's two independent layers): for each layer `update_and_fetch` then `attention`
over 2048 new queries (the integration's dispatcher marked installed, so update_and_fetch returns
the window only), then one evaluation of the outputs and the caches' arrays, as mlx-lm evaluates
the caches' state after each prefill chunk. Shape: batch 1, 8 kv heads, 32 query heads, head_dim
128, bfloat16, random K/V/queries, chunks of 2048 tokens until `--history` tokens are held.

mx.fast.scaled_dot_product_attention is replaced by bench.prefill_peak's stand-in (it reads its
K/V inputs, so everything the cache builds for it is evaluated, but builds no score matrix): the
attention kernel itself is the same fp16 attention for every method, on the CPU it would
materialise 4 GiB of scores per layer at 16K, and it is not what differs between the methods.

Reported per chunk (the last `--measure` chunks, each one pair):
  ms           wall time of the pair's calls and the chunk's evaluation (medians, min, max);
  syncs        mx.eval / mx.async_eval calls the caches made (the chunk's own final evaluation
               not counted): each drains the GPU queue on CUDA;
  primitives   ops of the lazy graphs the pair built (bench_encoders.graph_size's count: views
               left out; ~ kernel launches on a GPU), counted where the graph is evaluated: at
               each sync and at the chunk's evaluation. The flash stand-in adds 9 per layer
               (Multiply 2, AsType 3, Sum 2, Add 2), the same for every method.
`--emulate`: with our CUDA kernels on and run by tests/cache/cuda_emulation.py (the H200's
path); counts only (the emulation's times mean nothing), at a short history.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import statistics
import sys
import time
from collections import Counter

import mlx.core as mx

from tests.cache.bench_encoders import VIEW_PRIMITIVES
from tests.cache.bench_output import bench_header, emit
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.bench.prefill_peak import flash_stand_in
from veloxquant_mlx.cache.registry import cache_class

B, H, HQ, D, CHUNK = 1, 8, 32, 128, 2048
LABELS_WANTED = False
# Two layers of each method as two consecutive layers of a model: minicache pairs from layer 0.
CONFIGS = {
    "kivi": {"method": "kivi"},
    "xquant": {"method": "xquant"},
    "minicache": {"method": "minicache", "minicache_start_fraction": 0.0},
}


class _Installed:
    installed = True


def make_pair(method: str):
    config = KVCacheConfig(**CONFIGS[method])
    cls = cache_class(method)
    caches = cls.build_layers(config, 2) if hasattr(cls, "build_layers") else [cls(config, i, 2) for i in range(2)]
    for cache in caches:
        cache._dispatcher = _Installed()
    return caches


LABELS: Counter = Counter()  # every counted primitive by name (--labels)


def kernels(arrays) -> int:
    arrays = [a for a in arrays if isinstance(a, mx.array)]
    if not arrays:
        return 0
    dot = io.StringIO()
    mx.export_to_dot(dot, *arrays)
    nodes = Counter(re.findall(r'label ?= ?"([A-Za-z_]+)"', dot.getvalue()))
    counted = {k: v for k, v in nodes.items() if k not in VIEW_PRIMITIVES}
    LABELS.update(counted)
    return sum(counted.values())


@contextlib.contextmanager
def counted_syncs(tally: dict):
    """mx.eval / mx.async_eval counted, with the primitives each evaluates."""
    real = mx.eval, mx.async_eval

    def wrap(fn):
        def counted(*args):
            # The emulation evaluates a kernel's inputs to hand them to its program: not a sync
            # of the cache's (on CUDA the kernel's launch is queued like any op).
            if "cuda_emulation" not in sys._getframe(1).f_code.co_filename:
                tally["syncs"] += 1
            tally["primitives"] += kernels(_flatten(args))
            return fn(*args)
        return counted

    launch = None
    if "tests.cache.cuda_emulation" in sys.modules:
        # An emulated kernel runs eagerly and returns evaluated arrays: its launch is counted
        # here as the one primitive it is on CUDA.
        emulation = sys.modules["tests.cache.cuda_emulation"].EmulatedKernel
        launch = emulation.__call__

        def counted_launch(self, *args, **kwargs):
            # + the launch; - the emulation's mx.contiguous of each input (a node per input,
            # counted at its evaluation; MLX's CUDA backend copies only inputs that are not row
            # contiguous: the encode kernels' K/V blocks, slices of the window, for kivi and
            # xquant alike -- those real copies are left out of the count too).
            n_inputs = len(kwargs["inputs"])
            tally["primitives"] += 1 - n_inputs
            tally["kernel_launches"] += 1
            LABELS.update({"Contiguous": -n_inputs})
            LABELS.update([f"kernel:{self.name}"])
            return launch(self, *args, **kwargs)

        emulation.__call__ = counted_launch
    mx.eval, mx.async_eval = wrap(real[0]), wrap(real[1])
    try:
        yield
    finally:
        mx.eval, mx.async_eval = real
        if launch is not None:
            emulation.__call__ = launch


def _flatten(tree) -> list:
    if isinstance(tree, mx.array):
        return [tree]
    if isinstance(tree, dict):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [a for t in tree for a in _flatten(t)]
    return []


def cache_arrays(cache) -> list:
    return [*cache.store.values(), cache.window_keys, cache.window_values,
            getattr(cache, "sink_keys", None), getattr(cache, "sink_values", None)]


def run_chunk(caches, seed: int, count: bool) -> dict:
    keys = mx.random.split(mx.random.key(seed), 3 * len(caches))
    inputs = [(mx.random.normal((B, H, CHUNK, D), key=keys[3 * i]).astype(mx.bfloat16),
               mx.random.normal((B, H, CHUNK, D), key=keys[3 * i + 1]).astype(mx.bfloat16),
               mx.random.normal((B, HQ, CHUNK, D), key=keys[3 * i + 2]).astype(mx.bfloat16))
              for i in range(len(caches))]
    mx.eval(inputs)
    tally = {"syncs": 0, "primitives": 0, "kernel_launches": 0}
    per_layer = []
    start = time.perf_counter()
    outs = []
    for cache, (k, v, q) in zip(caches, inputs):
        with counted_syncs(tally) if count else contextlib.nullcontext():
            cache.update_and_fetch(k, v)
            outs.append(cache.attention(q, scale=D**-0.5, mask="causal"))
        if count:
            # Counting: each layer's graph evaluated on its own, so that it is counted once.
            final = [outs[-1]] + [a for c in caches for a in cache_arrays(c)]
            tally["primitives"] += kernels(final)
            mx.eval([a for a in final if a is not None])
            per_layer.append(dict(tally, labels=dict(LABELS)))
            LABELS.clear()
    final = outs + [a for c in caches for a in cache_arrays(c)]
    mx.eval([a for a in final if a is not None])
    tally["ms"] = 1e3 * (time.perf_counter() - start)
    if count:
        tally["per_layer"] = [per_layer[0]] + [{k: (b[k] if k == "labels" else b[k] - a[k]) for k in a}
                                               for a, b in zip(per_layer, per_layer[1:])]
        if not LABELS_WANTED:
            for layer in tally["per_layer"]:
                del layer["labels"]
    return tally


def measure(method: str, history: int, measure_chunks: int, emulate: bool) -> dict:
    caches = make_pair(method)
    rows = []
    n_chunks = history // CHUNK
    for i in range(n_chunks):
        timed = i >= n_chunks - measure_chunks
        # Timing runs uncounted (the counting exports graphs); counts from a second pair of
        # caches would need the same history, so the counted chunk is the last one.
        rows.append(run_chunk(caches, seed=i, count=timed and emulate))
    if not emulate:
        counted_pair = make_pair(method)
        for i in range(n_chunks):
            counted = run_chunk(counted_pair, seed=i, count=i == n_chunks - 1)
        counts = {k: counted[k] for k in ("syncs", "primitives", "kernel_launches", "per_layer")}
    else:
        counts = {k: rows[-1][k] for k in ("syncs", "primitives", "kernel_launches", "per_layer")}
    ms = [r["ms"] for r in rows[-measure_chunks:]]
    return {
        "pair_chunk_ms": {"median": round(statistics.median(ms), 1), "min": round(min(ms), 1),
                          "max": round(max(ms), 1), "n": len(ms)},
        "last_chunk": counts,
        "history_at_last_chunk": (n_chunks - 1) * CHUNK,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="kivi,xquant,minicache")
    p.add_argument("--history", type=int, default=16384, help="tokens held after the last chunk")
    p.add_argument("--measure", type=int, default=4, help="chunks timed (the last ones)")
    p.add_argument("--repeats", type=int, default=1, help="fills per method, interleaved")
    p.add_argument("--emulate", action="store_true", help="CUDA kernels on, emulated (counts only)")
    p.add_argument("--labels", action="store_true", help="per layer, the counted primitives by name")
    p.add_argument("--out")
    args = p.parse_args(argv)
    global LABELS_WANTED
    LABELS_WANTED = args.labels
    load = os.getloadavg()
    result = {**bench_header("tests.cache.bench_pair_prefill", argv),
              "shape": {"batch": B, "kv_heads": H, "q_heads": HQ, "head_dim": D, "chunk": CHUNK, "dtype": "bfloat16"},
              "rows": {}}
    emulation = contextlib.nullcontext()
    if args.emulate:
        import importlib

        from tests.cache.cuda_emulation import emulated_kernels

        # The encode kernels have their own switch, which emulated_kernels leaves off (see
        # fused_encode_affine._kernels_enabled): on the H200 they run. (fused_encode_xquant is
        # looked up by name: the tree before it existed runs this bench too.)
        for name in ("fused_encode_affine", "fused_encode_xquant"):
            try:
                module = importlib.import_module(f"veloxquant_mlx.cache.{name}")
            except ImportError:
                continue
            module._kernels_enabled = lambda: True
        emulation = emulated_kernels()
    with flash_stand_in(), emulation:
        for r in range(args.repeats):
            for method in args.methods.split(","):
                row = measure(method, args.history, args.measure, args.emulate)
                result["rows"].setdefault(method, []).append(row)
                print(method, json.dumps(row), flush=True)
    result["load_average_before_after"] = [load, os.getloadavg()]
    emit(result, args.out)


if __name__ == "__main__":
    main()
