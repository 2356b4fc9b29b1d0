"""Where a model's prefill time goes, chunk by chunk: host graph building against evaluation.

    python -m veloxquant_mlx.bench.prefill_chunks --methods fp16,kivi --context 32768 --out X.json

gpu_speed times a whole prefill; this splits it. The prompt is fed as drive.prefill (and
mlx-lm's generate_step) feeds it: chunks of `--prefill-step-size`, the cache state evaluated and
MLX's buffer cache cleared after each. Per chunk it records the host seconds spent building the
model call's graph (`host_ms`: Python, our caches' update and attention dispatch, and any host
sync a cache makes inside the call) and the seconds the evaluation then takes (`eval_ms`: the
launches and the device's work left at the eval). A chunk's time is their sum. What "host"
holds differs by cache: since session 13 our caches' prefill attention starts with an
`mx.async_eval` of its queries (base.PREFILL_START_QUERIES), so their host time includes MLX
encoding and launching the earlier layers' work, which fp16 does inside its eval (half of
turboquant_rvq's host time on the H200 in session 18, bench/host_profile.py): the split shows
where the wall time passes, not what our Python costs.

Per spec: one untimed fill of the whole context (the JIT compiles of every history length),
then `--fills` timed fills. Summary per spec (medians over the timed fills): total, host and
eval seconds, and a least-squares line of eval_ms against the chunk's history length (the
intercept is a chunk's fixed cost, the slope its cost per thousand history tokens: a history
decode or a concatenation grows with it, an encode does not).
`--keep-buffers` skips the clear_cache between chunks (what the allocator's fresh allocations
cost); `--set MODULE.NAME=VALUE` as for gpu_speed; `--alternate MODULE.NAME=VALUE` times every
spec with and without a setting, fills alternating, in one process. Each fill also records its
peak memory over its start.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time

from veloxquant_mlx.bench import constants

MODULE = "veloxquant_mlx.bench.prefill_chunks"


def parse_args(argv=None) -> argparse.Namespace:
    from veloxquant_mlx.bench.gpu_speed import LLAMA_8B

    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--methods", default="fp16,kivi", help="cache specs as for `veloxquant bench`; fp16 is added first")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--fills", type=int, default=2, help="timed fills per spec after its untimed one (default 2)")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    for name, value in LLAMA_8B.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--keep-buffers", action="store_true", help="do not clear MLX's buffer cache between chunks")
    p.add_argument("--budget-s", type=float, default=400.0, help="start no new spec after this many seconds")
    constants.add_set_option(p)
    p.add_argument("--alternate", default=None, metavar="MODULE.NAME=VALUE",
                   help="time each spec's fills alternately as set (after --set) and with this setting "
                        "too, in one process (the JIT compiles paid once); its summary is SPEC@SETTING")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("context", "fills", "prefill_step_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: allowed is an integer >= 1")
    args.set = constants.parsed_settings(p, args.set)
    if args.alternate is not None:
        try:
            args.alternate = (args.alternate, constants.parse_setting(args.alternate))
        except ValueError as exc:
            p.error(f"--alternate: {exc}")
    return args


def timed_fill(model, cache: list, prompt, step: int, keep_buffers: bool, profile=None) -> dict:
    """Feed `prompt` (all but its last token, as drive.prefill) chunk by chunk; -> per-chunk
    history length, host ms and eval ms, and the fill's total seconds. `profile` (a
    cProfile.Profile, or None): enabled around each chunk's model call only, the span host_ms
    times (bench/host_profile.py)."""
    import mlx.core as mx

    from veloxquant_mlx.bench.drive import cache_arrays

    chunks = []
    active_before = mx.get_active_memory()
    mx.reset_peak_memory()
    start_fill = time.perf_counter()
    start = 0
    while prompt.size - start > 1:
        n = min(step, prompt.size - start - 1)
        t0 = time.perf_counter()
        if profile is not None:
            profile.enable()
        model(prompt[start : start + n][None], cache=cache)
        if profile is not None:
            profile.disable()
        t1 = time.perf_counter()
        mx.eval(cache_arrays(cache))
        t2 = time.perf_counter()
        chunks.append({"history": start, "tokens": n, "host_ms": 1e3 * (t1 - t0), "eval_ms": 1e3 * (t2 - t1)})
        start += n
        if not keep_buffers:
            mx.clear_cache()
    total = time.perf_counter() - start_fill
    return {"total_s": total, "peak_over_start_bytes": int(mx.get_peak_memory() - active_before), "chunks": chunks}


def line_fit(xs: list[float], ys: list[float]) -> dict | None:
    """Least-squares y = intercept + slope * x; None for fewer than two distinct x."""
    if len(set(xs)) < 2:
        return None
    mx_, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx_) ** 2 for x in xs)
    slope = sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / sxx
    return {"intercept": my - slope * mx_, "slope": slope}


def summarize(fills: list[dict]) -> dict:
    """Medians over the timed fills of total / host / eval seconds, and the eval line per 1K
    history tokens (ms) over every timed chunk."""
    host = [sum(c["host_ms"] for c in f["chunks"]) / 1e3 for f in fills]
    ev = [sum(c["eval_ms"] for c in f["chunks"]) / 1e3 for f in fills]
    chunks = [c for f in fills for c in f["chunks"]]
    fit = line_fit([c["history"] / 1024 for c in chunks], [c["eval_ms"] for c in chunks])
    return {
        "total_s": statistics.median(f["total_s"] for f in fills),
        "host_s": statistics.median(host),
        "eval_s": statistics.median(ev),
        "host_ms_per_chunk": statistics.median(c["host_ms"] for c in chunks),
        "peak_over_start_bytes": max(f["peak_over_start_bytes"] for f in fills),
        "eval_fit_ms_per_1k_history": fit,
    }


def with_ratios(summaries: dict) -> dict:
    """Each spec's totals over fp16's, and its excess over fp16 split into host and eval."""
    ref = summaries.get("fp16")
    if not ref:
        return summaries
    for s in summaries.values():
        s["total_vs_fp16"] = s["total_s"] / ref["total_s"]
        s["excess_host_s"] = s["host_s"] - ref["host_s"]
        s["excess_eval_s"] = s["eval_s"] - ref["eval_s"]
    return summaries


@contextlib.contextmanager
def alternated(alternate, active: bool):
    """Within: `alternate`'s setting applied when `active` (restored after)."""
    if not active:
        yield
        return
    _, (module, name, value) = alternate
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def run(args) -> dict:
    import mlx.core as mx

    from veloxquant_mlx.bench import report
    from veloxquant_mlx.bench.methods import parse_specs, with_reference
    from veloxquant_mlx.bench.speed import _error_text, random_prompt
    from veloxquant_mlx.bench.tiny import random_llama

    t0 = time.perf_counter()
    constants_set = constants.apply_settings(args.set)
    specs = with_reference(parse_specs([m for m in args.methods.split(",") if m]))
    shape = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                 head_dim=args.head_dim, intermediate=args.intermediate, vocab=args.vocab)
    result = {**report.header(), "command": " ".join(["python -m", MODULE, *sys.argv[1:]]),
              "settings": {"context": args.context, "fills": args.fills, "prefill_step_size": args.prefill_step_size,
                           "keep_buffers": args.keep_buffers,
                           "alternate": args.alternate[0] if args.alternate else None, "dtype": args.dtype, "constants_set": constants_set},
              "model": {"kind": "random-weight llama (mlx-lm llama.Model)", **shape},
              "specs": {}, "summary": {}}
    model = random_llama(dtype=getattr(mx, args.dtype), seed=args.seed, **shape)
    prompt = random_prompt(args.vocab, args.context, args.seed)
    for spec in specs:
        if time.perf_counter() - t0 > args.budget_s:
            result["specs"][spec.name] = {"skipped": f"budget: {args.budget_s:.0f} s spent"}
            continue
        entry = result["specs"].setdefault(spec.name, {})
        variants = [spec.name] + ([f"{spec.name}@{args.alternate[0]}"] if args.alternate else [])
        try:
            with spec.open(model) as make_cache:
                cold = timed_fill(model, make_cache(), prompt, args.prefill_step_size, args.keep_buffers)
                entry["untimed_fill_s"] = cold["total_s"]
                fills = {v: [] for v in variants}
                for _ in range(args.fills):
                    for v in variants:  # alternating, so a drift of the machine hits both alike
                        gc.collect()
                        mx.clear_cache()
                        with alternated(args.alternate, v != spec.name):
                            fills[v].append(timed_fill(model, make_cache(), prompt, args.prefill_step_size,
                                                       args.keep_buffers))
            entry["fills"] = fills[spec.name]
            for v in variants:
                if v != spec.name:
                    result["specs"][v] = {"fills": fills[v]}
                result["summary"][v] = summarize(fills[v])
        except Exception as exc:  # noqa: BLE001 - recorded; the next spec runs
            entry["error"] = _error_text(exc)
        for v in variants:
            s = result["summary"].get(v)
            if s:
                print(f"[prefill_chunks] {v}: total {s['total_s']:.3f} s, host {s['host_s']:.3f}, "
                      f"eval {s['eval_s']:.3f}, fit {s['eval_fit_ms_per_1k_history']}", file=sys.stderr, flush=True)
        gc.collect()
        mx.clear_cache()
        report.write_json(result, args.out)
    with_ratios(result["summary"])
    result["elapsed_s"] = time.perf_counter() - t0
    report.write_json(result, args.out)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    result = run(args)
    for name, s in result["summary"].items():
        ratio = s.get("total_vs_fp16")
        print(f"{name:16s} total {s['total_s']:.3f} s ({ratio:.2f}x)  host {s['host_s']:.3f}  eval {s['eval_s']:.3f}"
              if ratio else f"{name:16s} total {s['total_s']:.3f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
