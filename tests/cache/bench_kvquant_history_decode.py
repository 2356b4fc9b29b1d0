"""kvquant's prefill history-decode launches (cache/kvquant_prefill_kernel.py) timed alone, on CUDA.

    python -m tests.cache.bench_kvquant_history_decode --out results/history_decode_h200.json

One layer of the 8B shape (batch 1, 8 KV heads x 128, bf16, kvquant's defaults: 3 bits, group
32, 1% outliers) filled with `--context` tokens in 2048-token chunks as mlx-lm's prefill does,
so the store holds context - 2048 tokens and the last chunk is the exact window. Then, per
case, one part's `history_decode` launch (the history and the window written out in bf16) is
built `--batch` times, the graphs handed to one mx.eval, and the wall time divided by the
batch: the device time per launch plus its share of the launch gaps. Median and minimum of
`--rounds` rounds; the cases run key, value, the key data read as per-token (the value
kernel's arithmetic on the key part's arrays: tells a kernel's cost apart from its data's),
then value and key again (their order's effect), then key and value with every output a fresh
allocation (`_fresh`: MLX's buffer cache emptied before each round, as a model's prefill
chunk meets it: session 42's value launch took 166 us there against ~56 alone). Session 16
wrote this as an ad-hoc device script to split Nsight Compute's 0.34 / 0.14 ms (value / key)
in a model's prefill chunk: alone both took ~0.17 ms before the output staging and ~0.06-0.09
after (results/history_decode_h200_s16_*.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx

CHUNK, KV_HEADS, DIM = 2048, 8, 128


class _Installed:
    """A dispatcher stand-in: update_and_fetch skips building the (unused) decoded K/V."""

    installed = True


def filled_cache(context: int):
    from veloxquant_mlx.cache.factory import KVCacheFactory
    from veloxquant_mlx.config import KVCacheConfig

    cache = KVCacheFactory.create(KVCacheConfig.from_dict({"method": "kvquant"}))
    cache._dispatcher = _Installed()
    shape = (1, KV_HEADS, CHUNK, DIM)
    for _ in range(0, context, CHUNK):
        # Keys with wide channels (outliers to keep), values plain.
        keys = (mx.random.normal(shape) * mx.exp(mx.random.normal(shape) * 0.5)).astype(mx.bfloat16)
        values = mx.random.normal(shape).astype(mx.bfloat16)
        cache.update_and_fetch(keys, values)
        mx.eval(list(cache.store.values()), cache.window_keys, cache.window_values)
    return cache


def launch(cache, part: str, per_token: bool):
    """A function that builds one `part`'s history_decode launch as the cache's prefill does."""
    from veloxquant_mlx.cache import kvquant_prefill_kernel

    codes, scale, zero, codebook, sink, *sparse = cache._reader_args(part)
    window = cache.window_keys if part == "key" else cache.window_values
    return lambda: kvquant_prefill_kernel.history_decode(
        codes, scale, zero, codebook, tuple(sparse) or None, sink, window,
        n_blocks=cache.n_compressed // cache.group_size, group=cache.group_size, dim=DIM, bits=cache.code_bits,
        per_token=per_token, cache_dtype=mx.bfloat16, out_dtype=mx.bfloat16)


def time_launch(build, *, batch: int, rounds: int, fresh: bool = False) -> dict:
    """`fresh`: MLX's buffer cache emptied before each round's evaluation, so every output is a
    new allocation, as in a model's prefill (mlx-lm clears the cache after each chunk); else the
    previous round's outputs are reused."""
    mx.eval(build())  # compiles
    per_launch = []
    for _ in range(rounds):
        outs = [build() for _ in range(batch)]
        if fresh:
            mx.clear_cache()
        start = time.perf_counter()
        mx.eval(outs)
        per_launch.append((time.perf_counter() - start) / batch * 1e3)
    return {"median_ms": statistics.median(per_launch), "min_ms": min(per_launch)}


# (label, part, read per token, fresh allocations)
CASES = (("key", "key", False, False), ("value", "value", True, False),
         ("key_data_per_token", "key", True, False), ("value_again", "value", True, False),
         ("key_again", "key", False, False), ("key_fresh", "key", False, True), ("value_fresh", "value", True, True))


def main(argv=None) -> None:
    from veloxquant_mlx.bench.report import machine_info

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--batch", type=int, default=10, help="launches per evaluation")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--out", help="JSON output path")
    args = p.parse_args(argv)
    cache = filled_cache(args.context)
    results = {"history_tokens": cache.n_compressed, "window_tokens": cache._window_length(), "cases": {}}
    for label, part, per_token, fresh in CASES:
        results["cases"][label] = time_launch(launch(cache, part, per_token), batch=args.batch, rounds=args.rounds,
                                              fresh=fresh)
        print(label, {k: round(v, 4) for k, v in results["cases"][label].items()}, flush=True)
    if args.out:
        record = {"command": "python -m tests.cache.bench_kvquant_history_decode " + " ".join(sys.argv[1:] if argv is None else argv),
                  "machine": machine_info(), "settings": vars(args), "results": results}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
