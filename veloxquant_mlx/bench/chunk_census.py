"""What one layer's prefill chunk builds and launches, per method, on CUDA's path, counted on the CPU.

    python -m veloxquant_mlx.bench.chunk_census --methods turboquant_rvq,kivi --out X.json
    python -m veloxquant_mlx.bench.chunk_census --methods turboquant_rvq --alternate base.SLACK_FROM_WRITE=0 --out X.json

Why: on the H200 a compressed cache's prefill chunk is partly host-bound (bench/prefill_chunks.py:
~11-13 ms of host time per 8-layer 2048-token chunk for turboquant_rvq, kvquant and gear against
fp16's 0.9 ms), and every primitive is a kernel launch there. Nsight Compute (bench/chunk_kernels.py)
counts the launches on the GPU; this counts them on the CPU, for changes made without a GPU and
for an A/B of a constant (`--alternate`).

How (step_census's machinery, which counts a decode step the same way): the caches come from
`patch_model_kv_cache` on a random mlx-lm llama with the 8B attention shape (32 query / 8 KV
heads, head_dim 128, bf16); `--history` tokens are prefilled on the portable path in chunks of
`--chunk`; then, with CUDA's Python-side choices taken (step_census.cuda_path: kernels on and
recorded, one node per launch, and MLX's fused ops stood in for), layer 0 takes two more chunks
of `--chunk` tokens (update_and_fetch, then the patched attention with a causal mask; the second
one counted, after the first has made the traces and kernels), and the unevaluated graph of its
attention output and state arrays is counted by primitive. A chunk's attention on the CPU is
composed of ~10 ops (matmuls, softmax, mask) where CUDA runs one fused kernel: those are in every
method's count alike, fp16's included.

What it cannot tell: the GPU's or the host's time per launch, and the launches a primitive makes
on CUDA (a concatenation of three parts copies three times; `launches` counts it once).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter

import mlx.core as mx

from veloxquant_mlx.bench import constants
from veloxquant_mlx.bench import step_census as census
from veloxquant_mlx.bench.report import header

METHODS = census.METHODS


def chunk_graph(method: str, *, history: int, chunk: int, seed: int = 0) -> Counter:
    """One layer's prefill chunk after `history` tokens -> primitive name -> count (kernel
    launches by the kernel's name)."""
    from veloxquant_mlx.bench.tiny import random_llama

    model = random_llama(hidden=256, layers=2, intermediate=64, vocab=64, dtype=mx.bfloat16, seed=seed,
                         **census.LLAMA_8B_ATTENTION)
    heads, kv_heads, head_dim = (census.LLAMA_8B_ATTENTION[k] for k in ("heads", "kv_heads", "head_dim"))
    with census.method_caches(method, model) as (caches, attention):
        census.prefill(caches, attention, history=history, chunk=chunk, kv_heads=kv_heads, heads=heads,
                       head_dim=head_dim, dtype=mx.bfloat16, seed=seed)
        recorder = census.KernelRecorder()
        counts = Counter()
        # One cuda_path for both chunks: entering it empties the kernel modules' factories (and
        # fused_decode.absent_input's arrays, which would be counted again as new Full nodes).
        with census.cuda_path(recorder):
            for round_ in range(2):  # the first makes the traces and kernels; the second is counted
                key = 4 * (seed * 1_000_003 + history + round_ * chunk)
                k = census._random((1, kv_heads, chunk, head_dim), mx.bfloat16, key)
                v = census._random((1, kv_heads, chunk, head_dim), mx.bfloat16, key + 1)
                q = census._random((1, heads, chunk, head_dim), mx.bfloat16, key + 2)
                mx.eval(k, v, q)
                first = len(recorder.launches)
                cache = caches[0]
                keys, values = cache.update_and_fetch(k, v)
                out = attention(q, keys, values, cache=cache, scale=head_dim ** -0.5, mask="causal")
                outputs = [out, *census.state_arrays(cache)]
                launched = {}
                for label, made in recorder.launches[first:]:
                    node = census.primitive_id(made)
                    if node is not None:
                        launched[node] = label
                counts = census.graph_counts(outputs, launched)
                mx.eval(outputs)
                del recorder.launches[first:]
    return counts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m veloxquant_mlx.bench.chunk_census", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--history", type=int, default=512, help="tokens cached before the counted chunk (default 512)")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (default 2048, mlx-lm's)")
    constants.add_set_option(p)
    p.add_argument("--alternate", default=None, metavar="MODULE.NAME=VALUE",
                   help="also count every method with this constant set (an A/B)")
    args = p.parse_args(argv)
    try:
        args.set = [constants.parse_setting(x) for x in args.set]
        args.alternate = constants.parse_setting(args.alternate) if args.alternate else None
    except ValueError as exc:
        p.error(f"--set / --alternate: {exc}")
    try:
        args.methods = census.method_list(args.methods)
    except ValueError as exc:
        p.error(str(exc))
    return args


def _row(counts: Counter) -> dict:
    return {"launches": census.launches_of(counts),
            "by_primitive": dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))}


def run(args) -> dict:
    settings = constants.apply_settings(args.set)
    rows = {}
    for method in args.methods:
        t0 = time.perf_counter()
        rows[method] = _row(chunk_graph(method, history=args.history, chunk=args.chunk))
        if args.alternate is not None:
            module, name, value = args.alternate
            saved = getattr(module, name)
            setattr(module, name, value)
            try:
                label = f"{method}@{module.__name__.rsplit('.', 1)[-1]}.{name}={int(value)}"
                rows[label] = _row(chunk_graph(method, history=args.history, chunk=args.chunk))
            finally:
                setattr(module, name, saved)
        print(f"[chunk_census] {method}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return {**header(), "settings": {"history": args.history, "chunk": args.chunk, "constants_set": settings},
            "methods": rows}


def main(argv=None) -> int:
    import json

    args = parse_args(argv)
    result = run(args)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for name, row in result["methods"].items():
        print(f"{name:40s} {row['launches']:4d} launches")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
