"""Where the host's time goes in a prefill or a decode, by Python function (cProfile).

    python -m veloxquant_mlx.bench.host_profile prefill --methods fp16,turboquant_rvq --out X.json
    python -m veloxquant_mlx.bench.host_profile decode --methods fp16,kvquant --steps 64 --out X.json
    python -m veloxquant_mlx.bench.host_profile decode --first-steps --methods gear --steps 300 --out X.json

Why: prefill_chunks splits a chunk into "host" (the model call) and "eval", and gpu_speed records
a decode step's host time; neither says which code the host time is spent in. On the H200
(session 18) turboquant_rvq's prefill host time was 12x fp16's; the profile showed half of it in
the `mx.async_eval` each layer's prefill attention makes (base._attend_prefill): MLX encoding and
launching the earlier layers' work, which fp16 does inside the chunk's final eval instead.

How: the random llama of prefill_chunks (8B-shaped by default), a `--context` prompt. prefill:
per spec one untimed fill (the JIT compiles), one timed fill, one fill with cProfile enabled only
around each chunk's model call (the graph building, and whatever MLX evaluates inside it):
prefill_chunks.timed_fill's chunks and its host span.
decode: per spec a prefill (drive.prefill), then gpu_speed's decode bursts (drive.decode, as
mlx-lm's generate steps): 16 untimed steps, 64 timed, `--steps` profiled; the profile covers
each step's model call, argmax and async_eval (the span drive.decode's host_s times). Step and
host times are medians per step. `--first-steps`: the `--steps` steps right after the prefill are
the profiled ones (no warm-up or timed burst before them), and each one's host ms is kept
(`profiled_host_ms`): what only a process's or a cache's first steps pay shows there (session
24: GEAR's first 255 steps each waited ~1.3 ms in fused_decode.window_rows' mx.eval, a cost the
warmed-up bursts above never saw).

What it cannot tell: MLX's functions are nanobind functions, which cProfile does not see: their
time counts as their caller's own time (e.g. the async_eval inside _attend_prefill).

Output: per spec the timings and the top `--top` functions by own time (ncalls, own and
cumulative seconds, per call in us), JSON.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import statistics
import sys

MODULE = "veloxquant_mlx.bench.host_profile"
WARM_STEPS, TIMED_STEPS = 16, 64


def parse_args(argv=None) -> argparse.Namespace:
    from veloxquant_mlx.bench.gpu_speed import LLAMA_8B

    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("prefill", "decode"))
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--methods", default="fp16,turboquant_rvq", help="cache specs as for `veloxquant bench`")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--steps", type=int, default=64, help="decode steps profiled (decode mode; default 64)")
    p.add_argument("--first-steps", action="store_true",
                   help="decode mode: profile the steps right after the prefill and keep each one's host ms")
    p.add_argument("--top", type=int, default=30, help="functions kept per spec (default 30)")
    p.add_argument("--layers", type=int, default=8)
    for name, value in LLAMA_8B.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.first_steps and args.mode != "decode":
        p.error(f"--first-steps is a decode-mode option; mode {args.mode!r} does not take it")
    for name in ("context", "prefill_step_size", "steps", "top"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: allowed is an integer >= 1")
    if args.context < 2:
        p.error(f"--context {args.context}: allowed is an integer >= 2 (a prompt to prefill and a token to decode)")
    return args


def top_functions(profile, top: int) -> list[dict]:
    """The profile's `top` functions by own time."""
    stats = pstats.Stats(profile)
    rows = []
    for (path, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        rows.append({"function": f"{path}:{line}({name})", "calls": calls, "own_s": own, "cumulative_s": cumulative,
                     "own_us_per_call": 1e6 * own / max(calls, 1)})
    rows.sort(key=lambda r: -r["own_s"])
    return rows[:top]


def _fill(model, cache, prompt, step: int, profile=None) -> dict:
    """prefill_chunks' timed fill (drive.prefill's chunks) -> its seconds and its model calls'."""
    from veloxquant_mlx.bench.prefill_chunks import timed_fill

    fill = timed_fill(model, cache, prompt, step, keep_buffers=False, profile=profile)
    return {"fill_s": fill["total_s"], "host_s": sum(c["host_ms"] for c in fill["chunks"]) / 1e3}


def _burst(model, cache, logits, tokens: int, profile=None, keep_steps: bool = False) -> tuple[dict, object]:
    """gpu_speed's decode burst -> (median interval and host ms per step, and with `keep_steps`
    each step's host ms; the logits to go on from)."""
    from veloxquant_mlx.bench.gpu_speed_interleave import decode_burst

    intervals, logits, host = decode_burst(model, cache, logits, tokens, profile)
    figures = {"step_ms": statistics.median(intervals), "host_median_ms": statistics.median(host)}
    return ({**figures, "host_ms": host} if keep_steps else figures), logits


def profile_spec(spec, model, prompt, args) -> dict:
    from veloxquant_mlx.bench.drive import prefill

    profile = cProfile.Profile()
    with spec.open(model) as make_cache:
        if args.mode == "prefill":
            _fill(model, make_cache(), prompt, args.prefill_step_size)  # the JIT compiles
            entry = _fill(model, make_cache(), prompt, args.prefill_step_size)
            profiled = _fill(model, make_cache(), prompt, args.prefill_step_size, profile)
            entry.update({f"profiled_{k}": v for k, v in profiled.items()})
        else:
            cache = make_cache()
            logits = prefill(model, cache, prompt, args.prefill_step_size)
            entry = {}
            if not args.first_steps:
                _, logits = _burst(model, cache, logits, WARM_STEPS)
                entry, logits = _burst(model, cache, logits, TIMED_STEPS)
            profiled, _ = _burst(model, cache, logits, args.steps, profile, keep_steps=args.first_steps)
            entry.update({f"profiled_{k}": v for k, v in profiled.items()})
    entry["top_by_own_time"] = top_functions(profile, args.top)
    return entry


def run(args) -> dict:
    import mlx.core as mx

    from veloxquant_mlx.bench import report
    from veloxquant_mlx.bench.methods import parse_specs
    from veloxquant_mlx.bench.speed import random_prompt
    from veloxquant_mlx.bench.tiny import random_llama

    shape = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                 head_dim=args.head_dim, intermediate=args.intermediate, vocab=args.vocab)
    model = random_llama(dtype=getattr(mx, args.dtype), seed=args.seed, **shape)
    prompt = random_prompt(args.vocab, args.context, args.seed)
    result = {**report.header(), "command": " ".join(["python -m", MODULE, *sys.argv[1:]]),
              "settings": {"mode": args.mode, "context": args.context, "prefill_step_size": args.prefill_step_size,
                           "steps": args.steps, "first_steps": args.first_steps, "dtype": args.dtype},
              "model": {"kind": "random-weight llama (mlx-lm llama.Model)", **shape}, "specs": {}}
    for spec in parse_specs([m for m in args.methods.split(",") if m]):
        entry = profile_spec(spec, model, prompt, args)
        result["specs"][spec.name] = entry
        timing = {k: round(v, 4) for k, v in entry.items() if isinstance(v, float)}
        print(f"[host_profile] {spec.name}: {timing}", file=sys.stderr, flush=True)
        gc.collect()
        mx.clear_cache()
    return result


def main(argv=None) -> int:
    from veloxquant_mlx.bench import report

    args = parse_args(argv)
    result = run(args)
    report.write_json(result, args.out)
    for name, entry in result["specs"].items():
        print(f"##### {name}")
        steps = entry.get("profiled_host_ms")
        if steps:
            print("  host ms per step, in order: " + " ".join(f"{ms:.1f}" for ms in steps))
        for row in entry["top_by_own_time"][:10]:
            print(f"  {row['own_s'] * 1e3:8.2f} ms own {row['calls']:6d} calls  {row['function']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
