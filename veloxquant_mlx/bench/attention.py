"""One layer's decode attention, timed alone: the kernel under `veloxquant bench`'s decode speed.

    python -m veloxquant_mlx.bench.attention --context 4096 --rounds 40 --out results/x.json

One query token (SmolLM2-135M's layer shape by default: 9 query heads over 3 KV heads,
head_dim 64, float32 as the CPU model runs) attends over `--context` cached tokens of random
K/V. Each cache is filled through `update_and_fetch` (the last token arriving as a decode step's
own K/V), then one attention call is timed per round, rounds interleaved across the specs:
- fp16 and mlx-q*: mlx-lm's own `scaled_dot_product_attention` with the cache's output, i.e.
  `mx.fast.scaled_dot_product_attention` or mlx-lm's quantized attention, as in a model;
- ours: `cache.attention`, the compressed-form attention our dispatcher calls in a model.
Reported per spec in microseconds: min, quartiles, median, max of wall time
(`microseconds`) and of the process's CPU time (`cpu_microseconds`, all threads: the steadier
figure on a shared CPU; run with OPENBLAS_NUM_THREADS=1), and the bytes one call adds to MLX's
peak memory (`peak_added_bytes`). The minimum is the least load-disturbed wall figure on a
shared CPU; the median is what a loaded machine gives.
minicache: the upper layer of a pair is timed (see _prepared_minicache_pair; the row's
`layer_timed` says whether it was paired: pass `minicache:minicache_start_fraction=0`).
On MLX's CUDA backend our caches run fused kernels (cache/fused_decode*.py);
`--kernels both` also times each of our specs with VELOXQUANT_CUDA_KERNELS=0 (the portable
path), as "<spec> (portable)". For the H200 figures:
    python -m veloxquant_mlx.bench.attention --context 131072 --q-heads 32 --kv-heads 8 \
        --head-dim 128 --dtype bfloat16 --methods fp16,kivi,xquant --kernels both --out X.json
"""

from __future__ import annotations

import sys

MODULE = "veloxquant_mlx.bench.attention"
DEFAULT_METHODS = ["fp16", "mlx-q4", "kivi", "kivi:bit_width_inlier=4"]


def parse_args(argv=None):
    from veloxquant_mlx.bench.command import add_layer_shape, add_methods, parser, positive

    p = parser(MODULE, __doc__)
    add_methods(p, DEFAULT_METHODS)
    p.add_argument("--context", type=positive, default=4096, help="cached tokens (default 4096)")
    add_layer_shape(p, dtype="float32")
    p.add_argument("--rounds", type=positive, default=40, help="timed calls per spec (default 40)")
    p.add_argument("--kernels", choices=("on", "both"), default="on",
                   help="'both': time our specs also with the CUDA kernels off (default on)")
    return p.parse_args(argv)


def prepared_call(spec, q, k, v, scale: float):
    """A zero-argument function running this spec's decode attention over k, v (filled once)."""
    import mlx.core as mx
    from mlx_lm.models.base import scaled_dot_product_attention

    from veloxquant_mlx.bench.drive import cache_arrays
    from veloxquant_mlx.cache.base import CompressedKVCache

    cache = spec.make()
    if getattr(cache, "method", None) == "minicache":
        return _prepared_minicache_pair(spec, q, k, v, scale)
    if isinstance(cache, CompressedKVCache):
        cache.update_and_fetch(k[:, :, :-1], v[:, :, :-1])
        cache.attention(q, scale=scale)  # flushes: the history is encoded as a prefill leaves it
        cache.update_and_fetch(k[:, :, -1:], v[:, :, -1:])
        mx.eval(cache_arrays([cache]))
        return cache, lambda: cache.attention(q, scale=scale)
    keys, values = cache.update_and_fetch(k, v)
    mx.eval(keys, values)
    return cache, lambda: scaled_dot_product_attention(q, keys, values, cache=cache, scale=scale, mask=None)


def _prepared_minicache_pair(spec, q, k, v, scale: float):
    """MiniCache merges a layer with its neighbour: a pair (layers 0 and 1 of 2) is filled, the
    upper layer with k, v plus a quarter of independent noise (cosine ~0.97 to the lower's: every
    token merges), and the upper layer's attention is timed (it reads the pair's directions held
    by the lower). With the default minicache_start_fraction 0.5 layer 1 of 2 is left unpaired
    (a plain layer: mx.fast attention over its exact K/V); `minicache:minicache_start_fraction=0`
    times a paired layer. Returns (upper, call) like prepared_call."""
    import mlx.core as mx

    from veloxquant_mlx.bench.drive import cache_arrays
    from veloxquant_mlx.cache.minicache import MiniCacheCache

    lower, upper = MiniCacheCache.build_layers(spec._config(), 2)
    noise = mx.random.split(mx.random.key(7), 2)
    layers = [(lower, k, v),
              (upper, (k + 0.25 * mx.random.normal(k.shape, key=noise[0])).astype(k.dtype),
               (v + 0.25 * mx.random.normal(v.shape, key=noise[1])).astype(v.dtype))]
    for cache, kk, vv in layers:  # the prompt, in layer order (the upper layer merges the pair)
        cache.update_and_fetch(kk[:, :, :-1], vv[:, :, :-1])
        cache.attention(q, scale=scale)
    for cache, kk, vv in layers:
        cache.update_and_fetch(kk[:, :, -1:], vv[:, :, -1:])
    mx.eval(cache_arrays([lower, upper]))
    upper.bench_role = "paired (upper)" if upper.n_compressed else "plain (unpaired)"
    return upper, lambda: upper.attention(q, scale=scale)


def _with_kernels(call, switch: str):
    """`call` with VELOXQUANT_CUDA_KERNELS set to `switch` around it (restored after)."""
    import os

    from veloxquant_mlx.cache.fused_decode import ENV_SWITCH

    def switched():
        before = os.environ.get(ENV_SWITCH)
        os.environ[ENV_SWITCH] = switch
        try:
            return call()
        finally:
            if before is None:
                os.environ.pop(ENV_SWITCH)
            else:
                os.environ[ENV_SWITCH] = before

    return switched


WARMUP = 2  # untimed calls per spec before the rounds


def _with_cpu_time(call, seconds: list):
    """`call`, evaluated, appending the process's CPU time (all threads) to `seconds`: far less
    sensitive than wall time to other jobs on a shared machine (set OPENBLAS_NUM_THREADS=1 so
    idle BLAS threads do not spin into it)."""
    import time

    import mlx.core as mx

    def measured():
        start = time.process_time()
        mx.eval(call())
        seconds.append(time.process_time() - start)

    return measured


def _peak_added(call) -> int:
    """Bytes one evaluated call adds to MLX's peak memory over what is active before it (the
    transients of the attention: scores, decoded or widened codes)."""
    import mlx.core as mx

    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(call())
    return int(mx.get_peak_memory() - before)


def run(args) -> dict:
    import mlx.core as mx

    from veloxquant_mlx.bench.command import result
    from veloxquant_mlx.bench.layer_specs import parse_layer_specs
    from veloxquant_mlx.bench.speed import _error_text
    from veloxquant_mlx.bench.timing import summarize, time_calls

    specs = parse_layer_specs(args.methods, DEFAULT_METHODS)
    dtype = getattr(mx, args.dtype)
    keys = mx.random.split(mx.random.key(args.seed), 3)
    shape = (1, args.kv_heads, args.context, args.head_dim)
    k = mx.random.normal(shape, key=keys[0]).astype(dtype)
    v = mx.random.normal(shape, key=keys[1]).astype(dtype)
    q = mx.random.normal((1, args.q_heads, 1, args.head_dim), key=keys[2]).astype(dtype)
    scale = args.head_dim ** -0.5
    calls, rows, held = {}, {}, []
    for spec in specs:
        rows[spec.name] = {"label": spec.label, "kind": spec.kind}
        try:
            cache, calls[spec.name] = prepared_call(spec, q, k, v, scale)
            held.append(cache)
            rows[spec.name]["cache_nbytes"] = int(cache.nbytes)
            if hasattr(cache, "bench_role"):  # minicache: which kind of layer was timed
                rows[spec.name]["layer_timed"] = cache.bench_role
        except Exception as exc:  # noqa: BLE001 - recorded; the other specs still run
            rows[spec.name]["error"] = _error_text(exc)
    if args.kernels == "both":
        for spec in specs:
            if spec.kind != "fp16" and spec.kind != "mlx-quantized" and spec.name in calls:
                rows[f"{spec.name} (portable)"] = dict(rows[spec.name])
                calls[f"{spec.name} (portable)"] = _with_kernels(calls[spec.name], "0")
                calls[spec.name] = _with_kernels(calls[spec.name], "1")
    cpu: dict[str, list[float]] = {}
    timed = {name: _with_cpu_time(call, cpu.setdefault(name, [])) for name, call in calls.items()}
    seconds = time_calls(timed, rounds=args.rounds, warmup=WARMUP)
    for name, values in seconds.items():
        rows[name]["microseconds"] = summarize(values, unit=1e-6)
        rows[name]["cpu_microseconds"] = summarize(cpu[name][WARMUP:], unit=1e-6)
        rows[name]["peak_added_bytes"] = _peak_added(calls[name])
    fp16 = rows.get("fp16", {}).get("microseconds", {}).get("median")
    for row in rows.values():
        median = row.get("microseconds", {}).get("median")
        if fp16 and median:
            row["median_vs_fp16"] = median / fp16
    return result(args, rows, specs, scale=scale)


def main(argv=None) -> int:
    from veloxquant_mlx.bench.command import run_module

    return run_module(MODULE, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
