"""Bytes against each method's own accounting, and the time to encode a prompt, without a model.

    python -m veloxquant_mlx.bench.encode --context 4096 --out results/x.json

Every cache spec is fed the same K/V (random, `--dtype` float16 by default, as an fp16 model's
cache holds; bytes do not depend on the values) of SmolLM2-135M's KV shape by default (30
layers x 3 KV heads x head_dim 64), `--chunk` tokens at a time; after each chunk our caches
get one decode query's attention, which is when a model's prefill makes them encode. Reported:
- `nbytes`: the caches' measured nbytes after the prompt (all layers, growth slack included),
  `ratio_vs_fp16` against 2 bytes per element for the same tokens (no slack), and against the
  measured nbytes of mlx-lm's KVCache when `fp16` is in the run;
- for our caches, `accounting_bits_per_element` (the method's `bits_per_element()`, what it
  claims for the compressed history) beside `store_bits_per_element` (8 x the store's bytes
  over the elements it has room for, slack excluded), their ratio, and where the tokens are
  (compressed, exact window, allocated capacity);
- `encode_s`: seconds to fill all layers (median and spread over `--rounds` interleaved rounds).
`veloxquant bench --parts memory` measures bytes and peak memory through a real prefill; this
module checks the accounting and isolates the encode cost from the model's own work.
"""

from __future__ import annotations

import sys

MODULE = "veloxquant_mlx.bench.encode"
DEFAULT_METHODS = ["fp16", "mlx-q4", "mlx-q2:group_size=32", "turboquant_rvq", "kivi", "kvquant", "gear"]


def parse_args(argv=None):
    from veloxquant_mlx.bench.command import add_layer_shape, add_methods, parser, positive

    p = parser(MODULE, __doc__)
    add_methods(p, DEFAULT_METHODS)
    p.add_argument("--context", type=positive, default=4096, help="prompt tokens (default 4096)")
    p.add_argument("--layers", type=positive, default=30)
    add_layer_shape(p, dtype="float16")
    p.add_argument("--chunk", type=positive, default=512, help="tokens per update (default 512)")
    p.add_argument("--rounds", type=positive, default=3, help="timed fills per spec (default 3)")
    return p.parse_args(argv)


def fill(spec, kv: list, chunk: int, query) -> list:
    """Fresh caches for every layer, each fed its layer's K/V `chunk` tokens at a time."""
    import mlx.core as mx

    from veloxquant_mlx.bench.drive import cache_arrays
    from veloxquant_mlx.cache.base import CompressedKVCache

    caches = []
    for index, (k, v) in enumerate(kv):
        cache = spec.make(index, len(kv))
        for start in range(0, k.shape[2], chunk):
            cache.update_and_fetch(k[:, :, start : start + chunk], v[:, :, start : start + chunk])
            if isinstance(cache, CompressedKVCache):
                mx.eval(cache.attention(query, scale=1.0))
        mx.eval(cache_arrays([cache]))
        caches.append(cache)
    return caches


def describe_bytes(caches: list, fp16_bytes: int) -> dict:
    from veloxquant_mlx.cache.base import CompressedKVCache

    nbytes = int(sum(c.nbytes for c in caches))
    row = {"nbytes": nbytes, "ratio_vs_fp16": nbytes / fp16_bytes,
           "bits_per_element": 16 * nbytes / fp16_bytes}
    if not all(isinstance(c, CompressedKVCache) for c in caches):
        return row
    accounting = [c.bits_per_element() for c in caches]
    # Bits per element the store holds, over the elements it has room for (slack excluded
    # from the count of elements, so an exact accounting gives a ratio of 1).
    store_bytes = sum(sum(a.nbytes for a in c.store.values()) for c in caches)
    slots = sum(c.capacity * c.n_kv_heads * (c.head_dim + c.value_dim) for c in caches)
    row.update({
        "accounting_bits_per_element": sum(accounting) / len(accounting),
        "store_bits_per_element": 8 * store_bytes / slots if slots else None,
        "compressed_tokens": caches[0].n_compressed,
        "window_tokens": caches[0]._window_length(),
        "capacity_tokens": caches[0].capacity,
    })
    if len(set(accounting)) > 1:  # per-layer bit widths
        row["accounting_bits_per_element_per_layer"] = accounting
    if slots and row["accounting_bits_per_element"]:
        row["store_over_accounting"] = row["store_bits_per_element"] / row["accounting_bits_per_element"]
    return row


def run(args) -> dict:
    import mlx.core as mx

    from veloxquant_mlx.bench.command import result
    from veloxquant_mlx.bench.layer_specs import parse_layer_specs
    from veloxquant_mlx.bench.speed import _error_text
    from veloxquant_mlx.bench.timing import summarize, time_calls

    specs = parse_layer_specs(args.methods, DEFAULT_METHODS)
    dtype = getattr(mx, args.dtype)
    shape = (1, args.kv_heads, args.context, args.head_dim)
    kv = []
    for layer in range(args.layers):
        kk, kv_key = mx.random.split(mx.random.key(args.seed + layer))
        kv.append((mx.random.normal(shape, key=kk).astype(dtype), mx.random.normal(shape, key=kv_key).astype(dtype)))
    query = mx.zeros((1, args.q_heads, 1, args.head_dim), dtype)
    mx.eval(kv, query)
    fp16_bytes = 2 * 2 * args.layers * args.kv_heads * args.context * args.head_dim
    rows, calls, built = {}, {}, {}
    for spec in specs:
        rows[spec.name] = {"label": spec.label, "kind": spec.kind}
        try:
            built[spec.name] = fill(spec, kv, args.chunk, query)  # also checks that it can
        except Exception as exc:  # noqa: BLE001 - recorded; the other specs still run
            rows[spec.name]["error"] = _error_text(exc)
            continue

        def call(spec=spec):
            built[spec.name] = fill(spec, kv, args.chunk, query)

        calls[spec.name] = call
    seconds = time_calls(calls, rounds=args.rounds, warmup=0)
    for name, caches in built.items():
        rows[name].update(describe_bytes(caches, fp16_bytes))
        rows[name]["encode_s"] = summarize(seconds[name])
    measured_fp16 = rows.get("fp16", {}).get("nbytes")
    for row in rows.values():
        if measured_fp16 and row.get("nbytes"):
            row["ratio_vs_fp16_kvcache_measured"] = row["nbytes"] / measured_fp16
    return result(args, rows, specs, fp16_bytes=fp16_bytes)


def main(argv=None) -> int:
    from veloxquant_mlx.bench.command import run_module

    return run_module(MODULE, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
