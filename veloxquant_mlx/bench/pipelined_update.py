"""Does mlx-lm's KVCache write a decode token in place when steps are pipelined as generate() runs them?

    python -m veloxquant_mlx.bench.pipelined_update --context 131072 --out X.json

Why: in session 11's 128K run on the H200, the fp16 KVCache's step alternated between ~1.5 and
4-6.5 ms (13 of 32 tokens), which none of our caches did. mlx-lm's KVCache writes each new token
into its preallocated buffers (`self.keys[..., prev:offset, :] = keys`, a SliceUpdate), which MLX
does in place only when it can take the input buffer over; mlx-lm's generate_step builds step n+1
and hands it to mx.async_eval before it waits for step n, whose graph still holds the buffer.

What it runs: one KVCache of 8 KV heads x 128 channels (bf16) holding `--context` tokens, then
`--steps` one-token steps, each the update plus a read of the last token (so the step's own work
is tiny and a copy of the buffers shows); `sync`: each step built and then waited on; `pipelined`:
generate_step's order (step n+1 built and async_eval'd, then step n's result read). Per step the
host's ms from building it to its result; medians and the list. A step that copies both buffers
moves 2 x context x 8 x 128 x 2 bytes (537 MB at 128K).
"""

from __future__ import annotations

import statistics
import sys
import time

MODULE = "veloxquant_mlx.bench.pipelined_update"
KV_HEADS, HEAD_DIM = 8, 128


def step_times(context: int, steps: int, pipelined: bool) -> list[float]:
    """ms per step of one KVCache (see the module docstring), the first (its growth) excluded."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    prompt = mx.random.normal((1, KV_HEADS, context, HEAD_DIM), key=mx.random.key(0)).astype(mx.bfloat16)
    cache.update_and_fetch(prompt, prompt)
    mx.eval(cache.keys, cache.values)
    del prompt
    token = mx.random.normal((1, KV_HEADS, 1, HEAD_DIM), key=mx.random.key(1)).astype(mx.bfloat16)
    mx.eval(token)

    def step():
        keys, values = cache.update_and_fetch(token, token)
        return keys[:, :, -1].astype(mx.float32).sum() + values[:, :, -1].astype(mx.float32).sum()

    times = []
    if pipelined:
        current = step()
        mx.async_eval(current)
        for _ in range(steps):
            start = time.perf_counter()
            following = step()
            mx.async_eval(following)
            current.item()
            times.append(1e3 * (time.perf_counter() - start))
            current = following
        current.item()
    else:
        for _ in range(steps + 1):
            start = time.perf_counter()
            step().item()
            times.append(1e3 * (time.perf_counter() - start))
        times = times[1:]  # the first step grows the buffers (a concatenation): not a token write
    return times


def parse_args(argv=None):
    from veloxquant_mlx.bench import command

    p = command.parser(MODULE, __doc__)
    p.add_argument("--context", type=command.positive, default=131072, help="tokens held before the steps")
    p.add_argument("--steps", type=command.positive, default=16, help="timed steps per mode (default 16)")
    return p.parse_args(argv)


def run(args) -> dict:
    import mlx.core as mx

    rows = {}
    for mode in ("sync", "pipelined"):
        times = step_times(args.context, args.steps, mode == "pipelined")
        rows[mode] = {"median_ms": statistics.median(times), "max_ms": max(times), "step_ms": times}
        print(f"[pipelined_update] {mode}: median {rows[mode]['median_ms']:.2f} ms per step", file=sys.stderr)
    buffer_bytes = 2 * args.context * KV_HEADS * HEAD_DIM * 2
    return {"settings": {"context": args.context, "steps": args.steps, "kv_heads": KV_HEADS,
                         "head_dim": HEAD_DIM, "dtype": "bfloat16", "device": str(mx.default_device()),
                         "buffers_bytes": buffer_bytes},
            "results": rows}


def main(argv=None) -> int:
    from veloxquant_mlx.bench import command

    return command.run_module(MODULE, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
