"""Attention error of each cache on synthetic K/V with outlier channels, no model needed.

    python -m veloxquant_mlx.bench.synthetic --data random-channels --out results/x.json

Real LLM keys have a few channels of large offset and spread, and rare spikes (KIVI, Liu et al.
2024, Fig. 2; KVQuant, Hooper et al. 2024, Sec. 3): the structure per-channel key quantization
and outlier handling exist for. Two data sets (fp16 K/V, head_dim 64, `--tokens` tokens):
- `random-channels`: 4 KV heads; keys N(0, 1) with 4 random channels scaled x5 and offset by
  +-8; values N(0, 1) with 0.2% spikes of +-10; 32 queries N(0, 1.5) per KV head.
- `fixed-channels`: 3 KV heads; keys N(0, 1) scaled x4, x3, x5, x6 on channels 3, 17, 40, 55,
  offset by +12, -8, +6 on channels 3, 17, 40, with 0.2% spikes x10; values N(0, 1); 4 queries
  per KV head, N(0, 0.6) divided by the channel scales (attention logits of std ~2.5).
All queries attend at one decode position with scale 1/sqrt(head_dim), the queries of a KV
head folded in as query heads sharing it (GQA). The reference is float32 attention over the
same fp16 K/V. Each cache is filled with the K/V through `update_and_fetch`, and attends once
(which makes ours encode, as after a prefill) before the measured call. Reported, as the mean
over `--seeds` data sets and per seed:
- `rel_error`: ||out - ref|| / ||ref|| over all query rows; `rel_error_rows`: the mean over
  query rows of each row's relative error;
- `attention_kl`: mean over rows of KL(ref weights || weights over the cache's decoded keys);
- `bits_per_element`: measured, 8 x nbytes over the K/V elements (exact window and slack
  included), and for ours `accounting_bits_per_element`, the method's own figure.
The cache's output is what a model would get: ours through `cache.attention` (the compressed
form), mlx-lm's through its own `scaled_dot_product_attention`.
"""

from __future__ import annotations

import sys

MODULE = "veloxquant_mlx.bench.synthetic"
DEFAULT_METHODS = ["mlx-q4", "mlx-q2:group_size=32", "turboquant_rvq", "kivi", "kvquant", "gear"]


def random_channels(seed: int, heads: int, tokens: int, head_dim: int, queries: int):
    import mlx.core as mx

    k1, k2, k3, k4, k5, k6 = mx.random.split(mx.random.key(seed), 6)
    keys = mx.random.normal((1, heads, tokens, head_dim), key=k1)
    channels = mx.random.permutation(head_dim, key=k2)[:4]
    is_outlier = mx.zeros((head_dim,)).at[channels].add(1.0) > 0
    keys = mx.where(is_outlier, keys * 5 + 8 * mx.sign(mx.random.normal((head_dim,), key=k5)), keys)
    values = mx.random.normal((1, heads, tokens, head_dim), key=k3)
    spikes = mx.random.uniform(shape=values.shape, key=k4) < 0.002
    values = mx.where(spikes, 10 * mx.sign(values), values)
    q = 1.5 * mx.random.normal((1, heads * queries, 1, head_dim), key=k6)
    return q, keys.astype(mx.float16), values.astype(mx.float16)


def fixed_channels(seed: int, heads: int, tokens: int, head_dim: int, queries: int):
    import mlx.core as mx

    k1, k2, k3, k4 = mx.random.split(mx.random.key(seed), 4)
    offsets = mx.zeros((head_dim,)).at[mx.array([3, 17, 40])].add(mx.array([12.0, -8.0, 6.0]))
    scales = mx.ones((head_dim,)).at[mx.array([3, 17, 40, 55])].multiply(mx.array([4.0, 3.0, 5.0, 6.0]))
    keys = mx.random.normal((1, heads, tokens, head_dim), key=k1) * scales + offsets
    keys = mx.where(mx.random.uniform(shape=keys.shape, key=k2) < 0.002, keys * 10, keys)
    values = mx.random.normal((1, heads, tokens, head_dim), key=k3)
    q = mx.random.normal((1, heads * queries, 1, head_dim), key=k4) / scales * 0.6
    return q, keys.astype(mx.float16), values.astype(mx.float16)


# name -> (function, default KV heads, default queries per KV head)
DATA = {"random-channels": (random_channels, 4, 32), "fixed-channels": (fixed_channels, 3, 4)}


def parse_args(argv=None):
    from veloxquant_mlx.bench.command import add_methods, parser, positive

    p = parser(MODULE, __doc__)
    p.add_argument("--data", choices=sorted(DATA), default="random-channels")
    add_methods(p, DEFAULT_METHODS)
    p.add_argument("--tokens", type=positive, default=1024)
    p.add_argument("--heads", type=positive, default=None, help="KV heads (default: the data set's)")
    p.add_argument("--queries", type=positive, default=None,
                   help="queries per KV head (default: the data set's)")
    p.add_argument("--head-dim", type=positive, default=64)
    p.add_argument("--seeds", type=positive, default=3)
    args = p.parse_args(argv)
    if args.data == "fixed-channels" and args.head_dim <= 55:
        p.error(f"--head-dim {args.head_dim} is invalid for fixed-channels: allowed is > 55 "
                "(its outlier channels are 3, 17, 40 and 55)")
    _, heads, queries = DATA[args.data]
    args.heads = args.heads or heads
    args.queries = args.queries or queries
    return args


def _weights(q, k, scale):
    """float32 attention weights (1, H_q, 1, T) of q over k with GQA."""
    import mlx.core as mx

    rep = q.shape[1] // k.shape[1]
    k = mx.repeat(k.astype(mx.float32), rep, axis=1)
    return mx.softmax((q.astype(mx.float32) * scale) @ k.swapaxes(-1, -2), axis=-1, precise=True)


def _cache_output(spec, q, k, v, scale):
    """(output, decoded keys, cache) of `spec` filled with k, v, as a model would read it."""
    import mlx.core as mx
    from mlx_lm.models.base import scaled_dot_product_attention

    from veloxquant_mlx.cache.base import CompressedKVCache

    cache = spec.make()
    q_model = q.astype(k.dtype)
    if isinstance(cache, CompressedKVCache):
        cache.update_and_fetch(k, v)
        mx.eval(cache.attention(q_model, scale=scale))  # flushes: the history is now encoded
        out = cache.attention(q_model, scale=scale)
        decoded_keys = cache._full_keys_values()[0]  # what the compressed attention computes with
        return out, decoded_keys, cache
    keys, values = cache.update_and_fetch(k, v)
    out = scaled_dot_product_attention(q_model, keys, values, cache=cache, scale=scale, mask=None)
    if spec.kind == "mlx-quantized":
        keys = mx.dequantize(*keys, group_size=cache.group_size, bits=cache.bits)
    return out, keys, cache


def measure(spec, q, k, v, scale: float) -> dict:
    import mlx.core as mx

    ref_w = _weights(q, k, scale)
    rep = q.shape[1] // k.shape[1]
    ref = ref_w @ mx.repeat(v.astype(mx.float32), rep, axis=1)
    out, decoded_keys, cache = _cache_output(spec, q, k, v, scale)
    out = out.astype(mx.float32)
    w = _weights(q, decoded_keys, scale)
    diff = out - ref
    row_err = mx.linalg.norm(diff, axis=-1) / mx.linalg.norm(ref, axis=-1)
    kl = mx.sum(ref_w * (mx.log(ref_w + 1e-30) - mx.log(w + 1e-30)), axis=-1)
    result = {
        "rel_error": (mx.linalg.norm(diff.reshape(-1)) / mx.linalg.norm(ref.reshape(-1))).item(),
        "rel_error_rows": row_err.mean().item(),
        "attention_kl": kl.mean().item(),
        "bits_per_element": 8 * cache.nbytes / (k.size + v.size),
    }
    if hasattr(cache, "bits_per_element") and callable(cache.bits_per_element):
        result["accounting_bits_per_element"] = cache.bits_per_element()
    return result


def run(args) -> dict:
    from veloxquant_mlx.bench.command import result
    from veloxquant_mlx.bench.layer_specs import parse_layer_specs
    from veloxquant_mlx.bench.speed import _error_text

    specs = parse_layer_specs(args.methods, DEFAULT_METHODS)
    make_data = DATA[args.data][0]
    scale = args.head_dim ** -0.5
    per_seed: dict[str, list[dict]] = {s.name: [] for s in specs}
    errors: dict[str, str] = {}
    for seed in range(args.seeds):
        q, k, v = make_data(seed, args.heads, args.tokens, args.head_dim, args.queries)
        for spec in specs:
            if spec.name in errors:
                continue
            try:
                per_seed[spec.name].append(measure(spec, q, k, v, scale))
            except Exception as exc:  # noqa: BLE001 - recorded; the other specs still run
                errors[spec.name] = _error_text(exc)
    results = {}
    for spec in specs:
        rows = per_seed[spec.name]
        entry = {"label": spec.label, "kind": spec.kind}
        if spec.name in errors:
            entry["error"] = errors[spec.name]
        if rows:
            entry["mean"] = {key: sum(r[key] for r in rows) / len(rows) for key in rows[0]}
            entry["per_seed"] = rows
        results[spec.name] = entry
    return result(args, results, specs, scale=scale)


def main(argv=None) -> int:
    from veloxquant_mlx.bench.command import run_module

    return run_module(MODULE, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
