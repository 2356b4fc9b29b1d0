"""GPU speed run: an 8B-shaped random-weight llama in bf16 at long contexts.

    python -m veloxquant_mlx.bench.gpu_speed --out results/gpu_speed_h200.json
    python -m veloxquant_mlx.bench.gpu_speed --quick --layers 2 --hidden 256 --contexts 512,1024 \
        --out /tmp/smoke.json                                   # CPU smoke test, seconds

Model: mlx-lm's llama with Llama-3-8B dimensions (hidden 4096, 32 query / 8 KV heads,
head_dim 128, intermediate 14336, vocab 128256) and N layers (default 8, as in FACTS.md),
random weights (speed does not depend on their values). For each cache spec (fp16 KVCache,
mlx-lm QuantizedKVCache 4-bit as `kv_bits=4` builds it, each of our installed methods through
`patch_model_kv_cache`) and each context: prefill the prompt in chunks of 2048 as mlx-lm's
generate does (timed), then decode greedily (warm-up tokens, then timed tokens; tokens/s from
the median per-token interval), with peak memory from `mx.reset_peak_memory()` before the
prompt. Each spec first runs one untimed warm-up case so the JIT compiles its shapes.

Robust: a failing case records its error text and the run continues; the JSON is rewritten
(summaries, ratios, targets) after every timed run, so a crash or a time-out keeps what was
measured; `--recompute FILE.json` re-derives those from the runs of a file written before that
(it then held only whole contexts). A spec whose warm-up fails is not timed (its cases are
recorded as skipped with the warm-up's error; `--run-after-failed-warmup` times it anyway).
`--budget-s` stops
starting new cases once spent (they are recorded as skipped); the default context order puts
the targets (32K, 128K) first for that reason. Needs only mlx and mlx-lm (no matplotlib: plot
the JSON elsewhere with `python -m veloxquant_mlx.bench.report FILE.json`).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

from veloxquant_mlx.bench import constants

LLAMA_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256)
DEFAULT_CONTEXTS = "32768,131072,4096,16384,65536"  # targets first: the budget may cut the tail
TARGETS = {  # issue 5: decode >= 0.9x fp16 at 32K, >= 1.0x at 128K; prefill at 32K <= 1.2x time
    "decode_ratio_min": {32768: 0.9, 131072: 1.0},
    "prefill_time_ratio_max": {32768: 1.2},
}


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m veloxquant_mlx.bench.gpu_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON output path")
    p.add_argument("--layers", type=int, default=8)
    for name, value in LLAMA_8B.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--contexts", type=_int_list, default=None,
                   help=f"context lengths, run in this order (default {DEFAULT_CONTEXTS})")
    p.add_argument("--methods", default="default",
                   help="cache specs as for `veloxquant bench` (default: fp16, mlx-q4 and each "
                        "of our installed methods)")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per case, interleaved over the specs (default 3)")
    p.add_argument("--warmup-tokens", type=int, default=4)
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--warmup-context", type=int, default=4096,
                   help="context of each spec's untimed warm-up case (covers the chunk shapes)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no new case after this many seconds (default 420)")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE", help=constants.HELP)
    p.add_argument("--run-after-failed-warmup", action="store_true",
                   help="time a spec whose warm-up failed anyway (default: its cases are recorded "
                        "as skipped, naming the warm-up's error)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: first context only (4096 unless --contexts), 8 decode tokens")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.set = [constants.parse_setting(x) for x in args.set]
    except ValueError as exc:
        p.error(f"--set: {exc}")
    if args.contexts is None:
        args.contexts = [4096] if args.quick else _int_list(DEFAULT_CONTEXTS)
    if args.quick:
        args.decode_tokens, args.warmup_tokens = min(args.decode_tokens, 8), min(args.warmup_tokens, 2)
        args.repeats = 1
    args.warmup_context = min(args.warmup_context, min(args.contexts))
    return args


def default_methods() -> list[str]:
    from veloxquant_mlx.cli.bench import installed_methods

    return ["fp16", "mlx-q4", *installed_methods()]


def _log(message: str) -> None:
    print(f"[gpu_speed {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(args) -> dict:
    import mlx.core as mx

    from veloxquant_mlx.bench import report
    from veloxquant_mlx.bench.memory import fp16_bytes_for
    from veloxquant_mlx.bench.methods import parse_specs, with_reference
    from veloxquant_mlx.bench.speed import _error_text, measure_case, random_prompt
    from veloxquant_mlx.bench.tiny import parameter_bytes, random_llama

    t0 = time.perf_counter()
    from veloxquant_mlx.cli.bench import resolve_methods

    constants_set = constants.apply_settings(args.set)

    names = resolve_methods(args.methods, default=default_methods())
    specs = with_reference(parse_specs(names))
    shape = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                 head_dim=args.head_dim, intermediate=args.intermediate, vocab=args.vocab)
    result = {
        **report.header(),
        "model": {"kind": "random-weight llama (mlx-lm llama.Model)", **shape, "dtype": args.dtype},
        "settings": {
            "contexts": args.contexts, "decode_tokens": args.decode_tokens,
            "warmup_tokens": args.warmup_tokens, "prefill_step_size": args.prefill_step_size,
            "warmup_context": args.warmup_context, "budget_s": args.budget_s, "quick": args.quick,
            "repeats": args.repeats, "cuda_kernels": os.environ.get("VELOXQUANT_CUDA_KERNELS", "1"),
            "seed": args.seed, "constants_set": constants_set,
            "mlx_quantized_note": "mlx-q4 is mlx-lm's QuantizedKVCache(group_size=64, bits=4) from "
                                  "the first token (what kv_bits=4 converts to)",
        },
        "specs": [{"name": s.name, "label": s.label, "kind": s.kind, "params": s.params} for s in specs],
        "warmup": {},
        "cases": [],
    }

    def save():
        # Every finished run is saved with its summaries, ratios and targets: a time-out keeps
        # what was measured (a context's cases used to be written only once all its repeats
        # had run, and a device time-out at 128K lost that context's finished runs).
        result["elapsed_s"] = time.perf_counter() - t0
        summarize_cases(result["cases"], specs)
        result["targets"] = check_targets(result["cases"])
        report.write_json(result, args.out)

    _log(f"building model {shape} {args.dtype}")
    model = random_llama(dtype=getattr(mx, args.dtype), seed=args.seed, **shape)
    result["model"]["parameter_bytes"] = parameter_bytes(model)
    result["model_build_s"] = time.perf_counter() - t0
    save()

    for spec in specs:
        _log(f"warm-up {spec.name} at {args.warmup_context}")
        start = time.perf_counter()
        entry = {}
        try:
            with spec.open(model) as make_cache:
                measure_case(model, make_cache, random_prompt(args.vocab, args.warmup_context, args.seed),
                             decode_tokens=2, warmup_tokens=1, prefill_step_size=args.prefill_step_size)
        except Exception as exc:  # noqa: BLE001 - recorded; its timed cases are then skipped
            entry["error"] = _error_text(exc)
        entry["seconds"] = time.perf_counter() - start
        result["warmup"][spec.name] = entry
        save()

    for context in args.contexts:
        prompt = random_prompt(args.vocab, context, args.seed)
        cases = {}
        # Repeats interleave the specs (spec A, B, ..., then A, B, ... again) so a slow drift of
        # the machine (clocks, other tenants) spreads over every spec instead of biasing one.
        for repeat in range(args.repeats):
            for spec in specs:
                if spec.name not in cases:
                    cases[spec.name] = {
                        "spec": spec.name, "label": spec.label, "kind": spec.kind, "context": context,
                        "fp16_bytes": fp16_bytes_for(model, context), "runs": []}
                    result["cases"].append(cases[spec.name])
                case = cases[spec.name]
                if case.get("error"):
                    continue  # a failing spec fails again: do not spend the budget on it
                warmup_error = result["warmup"][spec.name].get("error")
                if warmup_error and not args.run_after_failed_warmup:
                    # mlx-lm's 4-bit cache failed its 2K warm-up on the H200 and then ran its 128K
                    # case for over five minutes without an answer (session 5), ending the call.
                    case.setdefault("skipped", f"not run: its warm-up at {args.warmup_context} tokens failed "
                                               f"({warmup_error[:120]}); --run-after-failed-warmup runs it")
                    continue
                elapsed = time.perf_counter() - t0
                if elapsed > args.budget_s:
                    case.setdefault("skipped", f"budget: {elapsed:.0f} s spent of --budget-s {args.budget_s:.0f} "
                                               f"(repeat {repeat + 1} of {args.repeats} not started)")
                    continue
                _log(f"{spec.name} at {context} (repeat {repeat + 1}/{args.repeats})")
                try:
                    with spec.open(model) as make_cache:
                        run = measure_case(model, make_cache, prompt, decode_tokens=args.decode_tokens,
                                           warmup_tokens=args.warmup_tokens,
                                           prefill_step_size=args.prefill_step_size)
                except Exception as exc:  # noqa: BLE001 - one failing case must not end the run
                    case["error"] = _error_text(exc)
                    _log(f"  error: {case['error'][:200]}")
                    run = None
                if run:
                    case["runs"].append(run)
                    _log(f"  prefill {run['prefill_s']:.2f} s, decode {run['decode_tps']:.1f} tok/s, "
                         f"peak {run['peak_bytes'] / 2**30:.2f} GiB")
                gc.collect()
                mx.clear_cache()
                save()
        del prompt
    save()
    _log(f"done in {time.perf_counter() - t0:.0f} s -> {args.out}")
    return result


def summarize_cases(cases: list[dict], specs) -> None:
    """Per case: the summaries of its runs so far, the bytes ratio, and ratios against the
    references at the same context; cases sorted by context, then spec order."""
    from veloxquant_mlx.bench.speed import _add_ratios, _summary

    for case in cases:
        runs = case["runs"]
        for metric in ("prefill_tps", "decode_tps", "prefill_s", "peak_bytes",
                       "peak_over_start_bytes", "cache_bytes_after_prompt"):
            case[metric] = _summary([r[metric] for r in runs])
        if runs:
            case["bytes_ratio_vs_fp16"] = runs[0]["cache_bytes_after_prompt"] / case["fp16_bytes"]
    order = [s.name for s in specs]
    cases.sort(key=lambda c: (c["context"], order.index(c["spec"]) if c["spec"] in order else len(order)))
    _add_ratios(cases, specs)


def recompute(path: str) -> dict:
    """Re-derive the summaries, ratios and targets of a saved run from its runs (for files
    written before every run was summarized as it finished), in place."""
    import json

    from veloxquant_mlx.bench import report
    from veloxquant_mlx.bench.methods import parse_specs, with_reference

    with open(path) as f:
        result = json.load(f)
    specs = with_reference(parse_specs([s["name"] for s in result["specs"]]))
    summarize_cases(result["cases"], specs)
    result["targets"] = check_targets(result["cases"])
    result["recomputed_by"] = f"python -m veloxquant_mlx.bench.gpu_speed --recompute {path}"
    report.write_json(result, path)
    return result


def check_targets(cases: list[dict]) -> list[dict]:
    """Each of our methods against the issue's GPU targets, where both sides were measured."""
    rows = []
    by_key = {(c["spec"], c["context"]): c for c in cases}
    for case in cases:
        if case["kind"] != "ours":
            continue
        ref = by_key.get(("fp16", case["context"]))
        ratio = (case.get("ratio_vs", {}).get("fp16") or {}).get("decode_tps")
        minimum = TARGETS["decode_ratio_min"].get(case["context"])
        if minimum is not None:
            rows.append({"spec": case["spec"], "context": case["context"], "target": f"decode >= {minimum}x fp16",
                         "value": ratio, "met": None if ratio is None else ratio >= minimum})
        maximum = TARGETS["prefill_time_ratio_max"].get(case["context"])
        if maximum is not None:
            mine, theirs = case["prefill_s"]["median"], (ref or {}).get("prefill_s", {}).get("median")
            value = mine / theirs if mine and theirs else None
            rows.append({"spec": case["spec"], "context": case["context"],
                         "target": f"prefill time <= {maximum}x fp16", "value": value,
                         "met": None if value is None else value <= maximum})
    return rows


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--recompute"]:
        if len(argv) != 2:
            raise SystemExit("usage: python -m veloxquant_mlx.bench.gpu_speed --recompute FILE.json")
        result = recompute(argv[1])
        print(f"{len(result['cases'])} cases; rewrote {argv[1]}")
        return 0
    args = parse_args(argv)
    result = run(args)
    failed = [c for c in result["cases"] if c.get("error")]
    for c in result["cases"]:
        d = c["decode_tps"]["median"]
        r = (c.get("ratio_vs", {}).get("fp16") or {}).get("decode_tps")
        status = c.get("error", c.get("skipped", ""))[:100]
        print(f"{c['spec']:28} {c['context']:>7} prefill_s={c['prefill_s']['median'] or float('nan'):8.3f} "
              f"decode={d or float('nan'):8.1f} tok/s  x_fp16={r or float('nan'):5.2f} {status}")
    print(f"{len(result['cases'])} cases, {len(failed)} failed; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
