"""Every kernel one layer's last prefill chunk launches, timed by Nsight Compute: where a chunk's device time goes.

    ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
        --log-file ncu_kvquant.csv python3 -m veloxquant_mlx.bench.chunk_kernels profile --method kvquant
    python -m veloxquant_mlx.bench.chunk_kernels summarize --csv fp16=ncu_fp16.csv \
        --csv kvquant=ncu_kvquant.csv --out results/ncu_prefill_chunk_h200.json

Why: prefill_chunks.py splits a model's prefill into host building and evaluation, but not the
evaluation into kernels. Here one layer (the 8B attention shape: 32 query / 8 KV heads x 128,
bf16) is filled up to the last `--chunk` tokens of `--context` in a fresh cache, chunk by chunk
with their attention (only the last chunk is profiled), after a first cache has run
the same steps so that every kernel is compiled; then the profiler is started (cuProfilerStart,
so ncu's `--profile-from-start off` records just that) around that chunk's `update_and_fetch`, its
attention (`cache.attention` for ours, mlx-lm's SDPA call for fp16) and their evaluation.
Nsight Compute runs each kernel alone: the durations add up to the chunk's device time without
overlap or launch gaps, an upper bound on what the chunk costs the GPU in a model. `--timed N`
then times the same chunk N more times unprofiled (fresh caches; under ncu these include its
interception overhead).

`--decode-steps N` profiles N decode steps instead, after the whole `--context` is filled
(each step: one token's `update_and_fetch`, its one-row attention, evaluated, as mlx-lm's
generate makes them one at a time): where a decode step's device time goes, the fp16 KVCache's
fused attention against our decode kernels and whatever else a step launches (the README's 32K
decode gap: our steps' host time equals their interval in gpu_speed's rounds, so the step waits
on the device).

`steps` times each decode step end to end instead (no profiler): N steps after the context, each
evaluated and synchronized alone, for a few fresh caches per method.

`summarize` reads the CSVs (`--page details`' default, one metric) into per-method totals and
per-kernel sums (templates cut off the names), largest first, with each family's median and
largest launch (a decode profile's first step also encodes the prefill's last window).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import re
import statistics
import sys
import time

from veloxquant_mlx.bench import constants

MODULE = "veloxquant_mlx.bench.chunk_kernels"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    prof = sub.add_parser("profile", help="the workload to run under ncu")
    prof.add_argument("--method", required=True, help="fp16 or one of our methods (bench spec syntax)")
    prof.add_argument("--context", type=int, default=32768, help="prompt tokens (default 32768)")
    prof.add_argument("--chunk", type=int, default=2048, help="prefill chunk tokens (default 2048)")
    prof.add_argument("--timed", type=int, default=5, help="unprofiled timings of the same chunk (default 5)")
    prof.add_argument("--decode-steps", type=int, default=0,
                      help="profile this many decode steps after the whole context instead of its last chunk")
    steps = sub.add_parser("steps", help="each decode step's wall time after the context, per method")
    steps.add_argument("--methods", required=True, help="comma list: fp16 or our methods (bench spec syntax)")
    steps.add_argument("--context", type=int, default=32768, help="prompt tokens (default 32768)")
    steps.add_argument("--chunk", type=int, default=2048, help="prefill chunk tokens (default 2048)")
    steps.add_argument("--steps", type=int, default=12, help="decode steps timed per cache (default 12)")
    steps.add_argument("--repeats", type=int, default=2, help="fresh caches per method (default 2)")
    steps.add_argument("--out", help="JSON file for the step times (optional)")
    for parser in (prof, steps):
        constants.add_set_option(parser)
    summ = sub.add_parser("summarize", help="ncu CSVs -> JSON")
    summ.add_argument("--csv", action="append", required=True, metavar="METHOD=FILE")
    summ.add_argument("--out", required=True)
    summ.add_argument("--top", type=int, default=25, help="kernels kept per method (default 25)")
    args = p.parse_args(argv)
    if args.command in ("profile", "steps") and (args.chunk < 1 or args.context < 2 * args.chunk or args.context % args.chunk):
        p.error(f"--context {args.context} / --chunk {args.chunk}: allowed is a context of at least two "
                "chunks, a whole number of them")
    if args.command == "profile" and args.decode_steps < 0:
        p.error(f"--decode-steps {args.decode_steps}: allowed is 0 (the last chunk) or more steps")
    if args.command == "steps" and (args.steps < 1 or args.repeats < 1):
        p.error(f"--steps {args.steps} / --repeats {args.repeats}: allowed is at least 1 of each")
    if args.command in ("profile", "steps"):
        args.set = constants.parsed_settings(p, args.set)
    return args


def _profiler():
    """(start, stop) of the CUDA profiler; no-ops where there is no CUDA driver (the CPU)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return (lambda: None), (lambda: None)
    return cuda.cuProfilerStart, cuda.cuProfilerStop


def profile(method: str, context: int, chunk: int, timed: int, decode_steps: int = 0) -> dict:
    import mlx.core as mx

    from veloxquant_mlx.bench.kernel_probe import prefill_inputs, prefill_step
    from veloxquant_mlx.bench.layer_specs import parse_layer_spec

    k, v, q = prefill_inputs(context + decode_steps)
    spec = parse_layer_spec(method)
    last = context if decode_steps else context - chunk

    def step(cache, s0: int) -> None:
        """The profiled work from position s0: decode steps, or the last prefill chunk."""
        if decode_steps:
            for t in range(s0, s0 + decode_steps):
                decode_step(cache, k, v, q, t)
        else:
            prefill_step(cache, k, v, q, slice(s0, s0 + chunk))

    def filled():
        return filled_layer(spec, k, v, q, last, chunk)

    t0 = time.perf_counter()
    step(filled(), last)  # compiles every kernel of the profiled step
    warm_s = time.perf_counter() - t0
    start, stop = _profiler()
    cache = filled()
    cached_before = cache.offset
    start()
    step(cache, last)
    mx.synchronize()
    stop()
    seconds = []
    for _ in range(timed):
        cache = filled()
        t = time.perf_counter()
        step(cache, last)
        mx.synchronize()
        seconds.append(time.perf_counter() - t)
    return {"method": method, "context": context, "chunk": chunk, "decode_steps": decode_steps,
            "cached_before_profiled": cached_before, "warm_up_s": warm_s, "timed_chunk_s": seconds}


def filled_layer(spec, k, v, q, tokens: int, chunk: int):
    """A fresh cache of `spec` holding the first `tokens` of k / v, prefilled `chunk` at a time."""
    import mlx.core as mx

    from veloxquant_mlx.bench.kernel_probe import prefill_step

    cache = spec.make()
    for s0 in range(0, tokens, chunk):
        # Every chunk attended, as in a model: our caches encode a chunk at the next call
        # after it (its attention reads it from the window), so a chunk left unattended
        # would be encoded inside the profiled step too.
        prefill_step(cache, k, v, q, slice(s0, s0 + chunk))
    mx.synchronize()
    return cache


def step_times(spec, k, v, q, context: int, chunk: int, steps: int, repeats: int) -> list[list[float]]:
    """Seconds of each of `steps` decode steps of `spec`'s layer after the first `context`
    tokens of k / v / q, each evaluated and synchronized alone (host work, launches and device
    time together), for `repeats` fresh caches (the first also pays the compiles). Why beside
    the profile: Nsight Compute times kernels alone, not what a step costs end to end; this
    shows whether a step's cost holds from step to step (session 20: the first step also
    encodes the prefill's last window)."""
    import mlx.core as mx

    out = []
    for _ in range(repeats):
        cache = filled_layer(spec, k, v, q, context, chunk)
        seconds = []
        for t in range(context, context + steps):
            t0 = time.perf_counter()
            decode_step(cache, k, v, q, t)
            mx.synchronize()
            seconds.append(time.perf_counter() - t0)
        out.append(seconds)
    return out


def decode_step(cache, k, v, q, t: int) -> None:
    """Decode step t of one layer, evaluated: token t of k / v appended, its query row attended
    without a mask (kernel_probe.prefill_step of one token, as mlx-lm's generate steps)."""
    from veloxquant_mlx.bench.kernel_probe import prefill_step

    prefill_step(cache, k, v, q, slice(t, t + 1), mask=None)


def _kernel_family(name: str) -> str:
    """A kernel's name without its template arguments and parameter list."""
    name = re.sub(r"\(.*", "", name)
    return re.sub(r"<.*", "", name).replace("void ", "").strip()


def read_csv(path: str) -> list[tuple[str, float]]:
    """(kernel family, nanoseconds) per kernel of an ncu --csv log (its ==PROF== lines skipped)."""
    with open(path, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.reader(lines))
    if not rows:
        raise ValueError(f"{path}: no CSV rows (expected ncu --csv output with gpu__time_duration.sum)")
    head = rows[0]
    missing = [c for c in ("Kernel Name", "Metric Name", "Metric Value") if c not in head]
    if missing:
        raise ValueError(f"{path}: line 1 lacks the columns {missing}: allowed is ncu's --csv details page")
    name, metric, value = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
    out = []
    for i, r in enumerate(rows[1:], start=2):
        if r[metric] != "gpu__time_duration.sum":
            raise ValueError(f"{path}: CSV row {i}: metric {r[metric]!r}: allowed is gpu__time_duration.sum alone")
        out.append((_kernel_family(r[name]), float(r[value].replace(",", ""))))
    return out


def summarize(kernels: list[tuple[str, float]], top: int) -> dict:
    """Per family: launches, summed microseconds, and the median and largest launch. Why the
    last two: over decode steps the first step also encodes the window the prefill left (its
    attention kernel then takes 3-10x a later step's, session 20's profiles), so a family's sum
    over N steps is not N steady steps; the median launch is."""
    durations: dict[str, list[float]] = {}
    for family, ns in kernels:
        durations.setdefault(family, []).append(ns)
    ranked = sorted(durations.items(), key=lambda kv: -sum(kv[1]))
    return {"kernels": len(kernels), "total_us": sum(ns for _, ns in kernels) / 1e3,
            "by_kernel": [{"kernel": k, "launches": len(ns), "us": sum(ns) / 1e3,
                           "median_us": statistics.median(ns) / 1e3, "max_us": max(ns) / 1e3}
                          for k, ns in ranked[:top]]}


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = constants.apply_settings(args.set) if args.command in ("profile", "steps") else {}
    if args.command == "profile":
        got = profile(args.method, args.context, args.chunk, args.timed, args.decode_steps)
        times = sorted(got["timed_chunk_s"])
        median = f"{times[len(times) // 2] * 1e3:.3f} ms" if times else "-"
        what = f"{args.decode_steps} decode steps" if args.decode_steps else "last chunk"
        print(f"{args.method}: warm-up {got['warm_up_s']:.1f} s, {what} median {median}", flush=True)
        return 0
    from veloxquant_mlx.bench import report

    result = {**report.header(), "command": " ".join(["python -m", MODULE, *sys.argv[1:]]),
              "constants_set": settings, "methods": {}}
    if args.command == "steps":
        from veloxquant_mlx.bench.kernel_probe import prefill_inputs
        from veloxquant_mlx.bench.layer_specs import parse_layer_spec

        # Every spec checked and the inputs made once, before any method is timed.
        specs = {m.strip(): parse_layer_spec(m.strip()) for m in args.methods.split(",") if m.strip()}
        k, v, q = prefill_inputs(args.context + args.steps)
        for method, spec in specs.items():
            runs = step_times(spec, k, v, q, args.context, args.chunk, args.steps, args.repeats)
            result["methods"][method] = {"step_us": [[round(s * 1e6, 1) for s in run] for run in runs]}
            for i, run in enumerate(result["methods"][method]["step_us"]):
                print(f"{method} {i} step us: " + " ".join(f"{x:.0f}" for x in run), flush=True)
        if args.out:
            report.write_json(result, args.out)
        return 0
    for item in args.csv:
        method, sep, path = item.partition("=")
        if not sep or not method or not path:
            raise SystemExit(f"--csv {item!r}: allowed is METHOD=FILE")
        result["methods"][method] = summarize(read_csv(path), args.top)
        print(f"{method}: {result['methods'][method]['kernels']} kernels, "
              f"{result['methods'][method]['total_us']:.1f} us", flush=True)
    report.write_json(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
