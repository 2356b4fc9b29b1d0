"""Prefill peak memory of turboquant_rvq against kivi and the fp16 cache, measured on the CPU.

    python -m veloxquant_mlx.bench.prefill_peak --out results/turboquant_rvq_prefill_peak_cpu.json

Why: on the H200 (results/gpu_speed_h200_s3.json, 8B-shaped llama, 8 layers, bf16, 32K prompt
in 2048-token chunks) turboquant_rvq peaked at 11.2-12.5 GiB against 8.39 for mlx-lm's fp16
KVCache and 8.46-8.73 for kivi, although it holds 0.29x fp16's bytes. A prefill chunk's
attention (>= CompressedKVCache.prefill_rows queries) decodes the layer's whole history and runs
mx.fast attention over it; this module measures what that decode adds, two ways:

1. `layer`: one layer (batch 1, 8 kv heads, head_dim 128, model dtype), history of N tokens:
   peak memory one prefill chunk's K/V build adds (`_prefill_keys_values`, i.e. everything the
   cache does for a prefill chunk's attention except the attention kernel itself), for kivi
   (the base path), turboquant_rvq through the base path (`before`: the whole history decoded
   lazily in one graph, as until this module's commit) and through its own (`after`), with the
   ratio to the fp16 K/V of that history and whether before/after are bit-identical.
2. `model`: a random llama (8B widths per layer: 32 query / 8 kv heads, head_dim 128; a small
   hidden size so the CPU can run it), prompts prefilled in 2048-token chunks as mlx-lm does
   (bench/drive.py), peak over the start. mx.fast.scaled_dot_product_attention is replaced by
   a stand-in for a fused (flash) kernel: it keeps its K/V inputs alive until it runs and
   returns the queries' shape, with no score matrix. MLX's CPU attention materialises the
   (heads x 2048 x context) float32 scores (4 GiB per layer at 16K), which hides every cache's
   transient; the H200's fused kernel does not. The stand-in's outputs are meaningless: only
   memory is measured here.

Figures taken on a shared 2-core machine; memory figures do not depend on its load.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import time

import mlx.core as mx

MODULE = "veloxquant_mlx.bench.prefill_peak"
MiB = 1 << 20


def _fp16_kv_bytes(tokens: int, heads: int, head_dim: int) -> int:
    return 2 * tokens * heads * head_dim * 2


def _filled_cache(method: str, tokens: int, heads: int, head_dim: int, dtype, chunk: int = 2048):
    """A one-layer cache of `method` holding `tokens` random tokens, everything evaluated."""
    from veloxquant_mlx.bench.methods import parse_spec
    from veloxquant_mlx.cache.factory import KVCacheFactory
    from veloxquant_mlx.config import KVCacheConfig

    # The same settings as `--methods kivi,turboquant_rvq` in the benches (the policy defaults).
    cache = KVCacheFactory.create(KVCacheConfig.from_dict(parse_spec(method).params), 0, 1)
    for start in range(0, tokens, chunk):
        n = min(chunk, tokens - start)
        keys = mx.random.normal((1, heads, n, head_dim)).astype(dtype)
        values = mx.random.normal((1, heads, n, head_dim)).astype(dtype)
        cache.update_and_fetch(keys, values)
        cache._flush()
        mx.eval([a for a in cache.state if isinstance(a, mx.array)])  # as mlx-lm does per chunk
    return cache


def _peak_of(build):
    """(peak bytes added while `build()`'s arrays are evaluated, the arrays)."""
    gc.collect()
    mx.clear_cache()
    start = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    arrays = build()
    mx.eval(arrays)
    return mx.get_peak_memory() - start, time.perf_counter() - t0, arrays


def layer_rows(contexts, heads: int, head_dim: int, q_heads: int, dtype) -> list[dict]:
    from veloxquant_mlx.cache.base import CompressedKVCache

    base_path = CompressedKVCache._prefill_keys_values
    rows = []
    for tokens in contexts:
        for method in ("kivi", "turboquant_rvq"):
            cache = _filled_cache(method, tokens, heads, head_dim, dtype)
            held = cache.n_compressed + cache._window_length()
            fp16 = _fp16_kv_bytes(held, heads, head_dim)
            queries = mx.random.normal((1, q_heads, CompressedKVCache.prefill_rows, head_dim)).astype(dtype)
            mx.eval(queries)
            own = type(cache)._prefill_keys_values
            # turboquant_rvq's own path against the base one it replaced; kivi's own path is the
            # base one off CUDA (its CUDA kernel, fused_prefill_affine, runs only there).
            paths = [("before (base path)", base_path), ("after", own)] if method == "turboquant_rvq" else [("own", own)]
            reference = None
            for label, fn in paths:
                peak, seconds, (k, v) = _peak_of(lambda: fn(cache, queries))
                row = {
                    "method": method, "path": label, "history_tokens": held,
                    "dtype": str(dtype).split(".")[-1],
                    "peak_added_bytes": int(peak), "peak_added_mib": round(peak / MiB, 1),
                    "fp16_kv_bytes": fp16, "peak_over_fp16_kv": round(peak / fp16, 3),
                    "result_bytes": int(k.nbytes + v.nbytes), "seconds": round(seconds, 3),
                }
                if reference is None:
                    reference = (k, v)
                else:
                    row["bit_identical_to_before"] = bool(
                        mx.array_equal(k, reference[0]).item() and mx.array_equal(v, reference[1]).item())
                rows.append(row)
                print(f"[prefill_peak] layer {method} {label} {held}: {row['peak_added_mib']} MiB "
                      f"({row['peak_over_fp16_kv']}x fp16 K/V), {row['seconds']} s",
                      file=sys.stderr, flush=True)
                del k, v
            cache = reference = None  # freed before the next history is built
    return rows


def _flash_stand_in(queries, keys, values, *, scale, mask=None, sinks=None):
    # Holds K and V until it runs (as a fused kernel reading them does) without reading much of
    # them, and returns the queries' shape: no (heads x queries x keys) score matrix.
    touch = keys[..., :1, :1].astype(mx.float32).sum() + values[..., :1, :1].astype(mx.float32).sum()
    return queries * scale + (touch * 0).astype(queries.dtype)


@contextlib.contextmanager
def flash_stand_in():
    real = mx.fast.scaled_dot_product_attention
    mx.fast.scaled_dot_product_attention = _flash_stand_in
    try:
        yield
    finally:
        mx.fast.scaled_dot_product_attention = real


@contextlib.contextmanager
def queries_not_evaluated_first():
    """Every cache's prefill decode without evaluating the queries first
    (CompressedKVCache.prefill_eval_queries False): what that step saves."""
    from veloxquant_mlx.cache.base import CompressedKVCache

    CompressedKVCache.prefill_eval_queries = False
    try:
        yield
    finally:
        CompressedKVCache.prefill_eval_queries = True


@contextlib.contextmanager
def turboquant_base_path():
    """turboquant_rvq's prefill K/V through the base path (the code before this fix)."""
    from veloxquant_mlx.cache.base import CompressedKVCache
    from veloxquant_mlx.cache.turboquant_rvq import TurboQuantRVQCache

    own = TurboQuantRVQCache.__dict__["_prefill_keys_values"]
    TurboQuantRVQCache._prefill_keys_values = CompressedKVCache._prefill_keys_values
    try:
        yield
    finally:
        TurboQuantRVQCache._prefill_keys_values = own


LAZY = "queries not evaluated first"
MODEL_CASES = {  # label -> (cache spec, path)
    "fp16": ("fp16", None), "kivi": ("kivi", None),
    "before": ("turboquant_rvq", "before (base path)"),
    "pieces-only": ("turboquant_rvq", f"pieces, {LAZY}"),
    "after": ("turboquant_rvq", "after"),
    # The other caches take the base path: with and without its ordering step.
    "kivi-lazy": ("kivi", LAZY),
    **{m: (m, None) for m in ("xquant", "gear", "kvquant", "minicache")},
    **{f"{m}-lazy": (m, LAZY) for m in ("xquant", "gear", "kvquant", "minicache")},
}


def model_rows(contexts, shape: dict, dtype, case_labels=tuple(MODEL_CASES)) -> list[dict]:
    from veloxquant_mlx.bench.memory import measure_memory
    from veloxquant_mlx.bench.methods import parse_specs
    from veloxquant_mlx.bench.speed import random_prompt
    from veloxquant_mlx.bench.tiny import random_llama

    model = random_llama(dtype=dtype, **shape)
    cases = [MODEL_CASES[label] for label in case_labels]
    specs = {s.name: s for s in parse_specs(sorted({name for name, _ in cases}))}
    switches = {"before (base path)": turboquant_base_path,
                f"pieces, {LAZY}": queries_not_evaluated_first, LAZY: queries_not_evaluated_first}
    rows = []
    with flash_stand_in():
        for tokens in contexts:
            prompt = random_prompt(shape["vocab"], tokens)
            for name, path in cases:
                switch = switches[path]() if path in switches else contextlib.nullcontext()
                t0 = time.perf_counter()
                with switch, specs[name].open(model) as make_cache:
                    result = measure_memory(model, make_cache, prompt)
                row = {"method": name, "path": path, "context": tokens, **result,
                       "peak_over_start_gib": round(result["peak_over_start_bytes"] / 2**30, 3),
                       "seconds": round(time.perf_counter() - t0, 1)}
                rows.append(row)
                print(f"[prefill_peak] model {name} {path or ''} {tokens}: peak over start "
                      f"{row['peak_over_start_gib']} GiB, cache {result['cache_bytes'] / 2**30:.3f} GiB, "
                      f"{row['seconds']} s", file=sys.stderr, flush=True)
    return rows


PARTS = ("layer", "model")


def parse_args(argv=None) -> argparse.Namespace:
    from veloxquant_mlx.bench.command import parser

    p = parser(MODULE, __doc__)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--layer-contexts", default="4096,16384,32768")
    p.add_argument("--model-contexts", default="4096,8192,16384")
    p.add_argument("--model-cases", default=",".join(MODEL_CASES),
                   help=f"comma-separated, of: {', '.join(MODEL_CASES)}")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=1024)
    args = p.parse_args(argv)
    # Checked before anything runs: an unknown name is an error, never silently skipped.
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    args.model_cases = [x.strip() for x in args.model_cases.split(",") if x.strip()]
    for option, names, allowed in (("--parts", args.parts, PARTS), ("--model-cases", args.model_cases, MODEL_CASES)):
        unknown = sorted(set(names) - set(allowed))
        if unknown:
            p.error(f"{option} {','.join(unknown)}: allowed are {', '.join(allowed)}")
    return args


def main(argv=None) -> int:
    from veloxquant_mlx.bench import report

    from veloxquant_mlx.bench.command import start

    args = parse_args(argv)
    dtype = getattr(mx, args.dtype)
    parts = set(args.parts)
    heads, q_heads, head_dim = 8, 32, 128
    result = {
        **start(args),
        "settings": {"dtype": args.dtype, "kv_heads": heads, "q_heads": q_heads, "head_dim": head_dim,
                     "prefill_step_size": 2048},
    }
    if "layer" in parts:
        contexts = [int(c) for c in args.layer_contexts.split(",")]
        result["layer"] = layer_rows(contexts, heads, head_dim, q_heads, dtype)
    if "model" in parts:
        shape = dict(hidden=args.hidden, layers=args.layers, heads=q_heads, kv_heads=heads,
                     head_dim=head_dim, intermediate=args.intermediate, vocab=args.vocab)
        result["model_shape"] = {**shape, "attention": "flash stand-in (see module docstring)"}
        result["model"] = model_rows([int(c) for c in args.model_contexts.split(",")], shape, dtype,
                                     args.model_cases)
    if args.out:
        report.write_json(result, args.out)
    else:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
