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

Figures (gpu_speed_figures.py says why): prefill = the FASTEST repeat, because the warm-up runs
at a short context and every spec's first timed repeat at a long one pays that context's JIT
compiles (session 6, 32K: gear 20.3 s cold, 1.87 s warm; a median of 2 repeats mixed the two);
all repeats and their spread stay in the JSON. Decode = the median over repeats of each repeat's
median per-token interval, with the fastest and slowest repeat. The table and `targets` use these.

`--context-warmup`: before the timed repeats at each context, one untimed prefill + 2 decode
tokens per spec at that context (recorded under `context_warmup`), so even the first timed
repeat is warm and one repeat gives a warm prefill. It costs one cold prefill per spec and
context: at 128K on the H200 the single (cold) repeats of session 5 sum to ~68 s over 8 specs
(fp16 5.9, kivi 4.0, xquant 4.2, minicache 4.1, gear 8.0, turboquant_rvq 9.1, kvquant 30.1,
pyramidkv 2.8 s; results/gpu_speed_h200_s5_128k.json); at 32K session 6's cold first repeats
were fp16 1.05, kivi 2.18, minicache 8.64, gear 20.3 s.
With `--repeats 2` or more it buys nothing for prefill (the fastest repeat is warm) and costs
more than a third repeat would.

`--interleave` (gpu_speed_interleave.py): at each context every spec is prefilled (timed, as
above) and its cache kept; then decode runs in rounds of `--round-tokens` tokens per spec back
to back, so drift hits every spec alike; per spec the median per-token interval and, per round,
the ratio to fp16's interval in the same round (median, quartiles, range), which the decode
target then uses. Memory: every spec's cache is alive at once.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

from veloxquant_mlx.bench import constants
from veloxquant_mlx.bench.gpu_speed_figures import TARGETS, check_targets, summarize_cases, table_lines

__all__ = ["TARGETS", "check_targets", "main", "recompute", "run", "summarize_cases"]

LLAMA_8B = dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256)
DEFAULT_CONTEXTS = "32768,131072,4096,16384,65536"  # targets first: the budget may cut the tail


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
    p.add_argument("--rounds-allowance-s", type=float, default=30.0,
                   help="with --interleave, decode rounds may still start this many seconds past --budget-s "
                        "(a round of 8 caches x 8 tokens takes ~0.2 s at 32K): a budget spent on prefills, "
                        "e.g. a fresh machine's JIT compiles, still yields decode figures (default 30)")
    constants.add_set_option(p)
    p.add_argument("--run-after-failed-warmup", action="store_true",
                   help="time a spec whose warm-up failed anyway (default: its cases are recorded "
                        "as skipped, naming the warm-up's error)")
    p.add_argument("--context-warmup", action="store_true",
                   help="one untimed prefill + 2 decode tokens per spec at each context before its timed "
                        "repeats (its JIT compiles; ~68 s over 8 specs at 128K on the H200)")
    p.add_argument("--interleave", action="store_true",
                   help="keep every spec's prefilled cache at a context and decode them in rounds, "
                        "each round every spec for --round-tokens tokens: per-round ratios to fp16")
    p.add_argument("--round-tokens", type=int, default=4,
                   help="timed tokens per spec and round with --interleave (default 4); the rounds "
                        "are --decode-tokens / --round-tokens (at least 1)")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: first context only (4096 unless --contexts), 8 decode tokens")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.set = constants.parsed_settings(p, args.set)
    if args.contexts is None:
        args.contexts = [4096] if args.quick else _int_list(DEFAULT_CONTEXTS)
    if args.quick:
        args.decode_tokens, args.warmup_tokens = min(args.decode_tokens, 8), min(args.warmup_tokens, 2)
        args.repeats = 1
    if args.rounds_allowance_s < 0:
        p.error(f"--rounds-allowance-s {args.rounds_allowance_s}: allowed is a number >= 0")
    for name in ("decode_tokens", "repeats", "round_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: allowed is an integer >= 1")
    args.rounds = max(1, args.decode_tokens // args.round_tokens)
    args.warmup_context = min(args.warmup_context, min(args.contexts))
    return args


def default_methods() -> list[str]:
    from veloxquant_mlx.cli.bench import installed_methods

    return ["fp16", "mlx-q4", *installed_methods()]


def _log(message: str) -> None:
    print(f"[gpu_speed {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _new_case(spec, context: int, fp16_bytes: int) -> dict:
    return {"spec": spec.name, "label": spec.label, "kind": spec.kind, "context": context,
            "fp16_bytes": fp16_bytes, "runs": []}


def run(args) -> dict:
    import mlx.core as mx

    from veloxquant_mlx.bench import gpu_speed_interleave, report
    from veloxquant_mlx.bench.memory import fp16_bytes_for
    from veloxquant_mlx.bench.layer_specs import parse_layer_specs
    from veloxquant_mlx.bench.methods import with_reference
    from veloxquant_mlx.bench.speed import _error_text, measure_case, random_prompt
    from veloxquant_mlx.bench.tiny import parameter_bytes, random_llama

    t0 = time.perf_counter()
    constants_set = constants.apply_settings(args.set)

    # Layer specs: our methods, mlx-lm's caches and the code ablations (bench/ablations.py).
    specs = with_reference(parse_layer_specs(args.methods, default_methods()))
    shape = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                 head_dim=args.head_dim, intermediate=args.intermediate, vocab=args.vocab)
    result = {
        **report.header(),
        "model": {"kind": "random-weight llama (mlx-lm llama.Model)", **shape, "dtype": args.dtype},
        "settings": {
            "contexts": args.contexts, "decode_tokens": args.decode_tokens,
            "warmup_tokens": args.warmup_tokens, "prefill_step_size": args.prefill_step_size,
            "warmup_context": args.warmup_context, "budget_s": args.budget_s,
            "rounds_allowance_s": args.rounds_allowance_s, "quick": args.quick,
            "repeats": args.repeats, "cuda_kernels": os.environ.get("VELOXQUANT_CUDA_KERNELS", "1"),
            "seed": args.seed, "constants_set": constants_set,
            "context_warmup": args.context_warmup, "interleave": args.interleave,
            "round_tokens": args.round_tokens if args.interleave else None,
            "rounds": args.rounds if args.interleave else None,
            "mlx_quantized_note": "mlx-q4 is mlx-lm's QuantizedKVCache(group_size=64, bits=4) from "
                                  "the first token (what kv_bits=4 converts to)",
            "figures_note": "prefill: fastest repeat (figure.prefill_s; all in figure.prefill_repeats_s); "
                            "decode: median over repeats of each repeat's median interval, or with "
                            "--interleave over all timed tokens of the rounds, and per-round paired "
                            "ratios to fp16 (interleaved.ratio_vs_fp16)",
        },
        "specs": [{"name": s.name, "label": s.label, "kind": s.kind, "params": s.params} for s in specs],
        "warmup": {},
        "context_warmup": {},
        "cases": [],
    }
    if args.interleave:
        result["settings"]["interleave_memory_note"] = (
            "every spec's cache is alive during the rounds: a prefill's peak_bytes includes the "
            "caches prefilled before it; peak_over_start_bytes is its own")

    def save():
        # Every finished run is saved with its summaries, ratios and targets: a time-out keeps
        # what was measured (a context's cases used to be written only once all its repeats
        # had run, and a device time-out at 128K lost that context's finished runs).
        result["elapsed_s"] = time.perf_counter() - t0
        summarize_cases(result["cases"], specs, args.context_warmup)
        result["targets"] = check_targets(result["cases"])
        report.write_json(result, args.out)

    def over_budget(allowance_s: float = 0.0) -> str | None:
        """Why nothing more may start (None: it may): --budget-s spent, plus `allowance_s`."""
        elapsed = time.perf_counter() - t0
        if elapsed > args.budget_s + allowance_s:
            extra = f" + --rounds-allowance-s {allowance_s:.0f}" if allowance_s else ""
            return f"budget: {elapsed:.0f} s spent of --budget-s {args.budget_s:.0f}{extra}"
        return None

    def rounds_over_budget() -> str | None:
        # Decode rounds get the allowance on top. Session 13: a fresh machine's 32K run spent its
        # whole --budget-s on warm-ups and cold prefills and ran no decode round at all
        # (results/gpu_speed_h200_s13_32k_b.json).
        return over_budget(args.rounds_allowance_s)

    def may_start(spec, case, what: str) -> bool:
        """Whether `what` (a timed repeat, a warm-up) of this case may start; records why not."""
        if case.get("error"):
            return False  # a failing spec fails again: do not spend the budget on it
        warmup_error = result["warmup"][spec.name].get("error")
        if warmup_error and not args.run_after_failed_warmup:
            # mlx-lm's 4-bit cache failed its 2K warm-up on the H200 and then ran its 128K
            # case for over five minutes without an answer (session 5), ending the call.
            case.setdefault("skipped", f"not run: its warm-up at {args.warmup_context} tokens failed "
                                       f"({warmup_error[:120]}); --run-after-failed-warmup runs it")
            return False
        reason = over_budget()
        if reason:
            case.setdefault("skipped", f"{reason} ({what} not started)")
            return False
        return True

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
        fp16_bytes = fp16_bytes_for(model, context)
        cases = {spec.name: _new_case(spec, context, fp16_bytes) for spec in specs}
        result["cases"].extend(cases.values())
        if args.context_warmup:
            # One untimed prefill + decode at this context per spec: its shapes' JIT compiles.
            warmed = result["context_warmup"].setdefault(str(context), {})
            for spec in specs:
                if not may_start(spec, cases[spec.name], "context warm-up"):
                    continue
                _log(f"context warm-up {spec.name} at {context}")
                start = time.perf_counter()
                try:
                    with spec.open(model) as make_cache:
                        measure_case(model, make_cache, prompt, decode_tokens=2, warmup_tokens=1,
                                     prefill_step_size=args.prefill_step_size)
                    warmed[spec.name] = {"seconds": time.perf_counter() - start}
                except Exception as exc:  # noqa: BLE001 - its timed runs would fail alike
                    warmed[spec.name] = {"seconds": time.perf_counter() - start, "error": _error_text(exc)}
                    cases[spec.name]["error"] = f"context warm-up: {warmed[spec.name]['error']}"
                gc.collect()
                mx.clear_cache()
                save()
        if args.interleave:
            gpu_speed_interleave.run_context(
                model, specs, prompt, cases, repeats=args.repeats, rounds=args.rounds,
                round_tokens=args.round_tokens, warmup_tokens=args.warmup_tokens,
                prefill_step_size=args.prefill_step_size, may_start=may_start, over_budget=rounds_over_budget,
                save=save, log=_log)
            del prompt
            continue
        # Repeats interleave the specs (spec A, B, ..., then A, B, ... again) so a slow drift of
        # the machine (clocks, other tenants) spreads over every spec instead of biasing one.
        for repeat in range(args.repeats):
            for spec in specs:
                case = cases[spec.name]
                if not may_start(spec, case, f"repeat {repeat + 1} of {args.repeats}"):
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


def recompute(path: str) -> dict:
    """Re-derive the summaries, figures, ratios and targets of a saved run from its runs (and
    interleaved rounds), in place: brings files written before a figure changed (the median
    prefill of sessions 1-6 mixed cold and warm repeats) to the current figures."""
    import json

    from veloxquant_mlx.bench import report
    from veloxquant_mlx.bench.layer_specs import parse_layer_spec
    from veloxquant_mlx.bench.methods import refuse_repeats, with_reference

    with open(path) as f:
        result = json.load(f)
    specs = with_reference(refuse_repeats([parse_layer_spec(s["name"]) for s in result["specs"]]))
    summarize_cases(result["cases"], specs, bool(result.get("settings", {}).get("context_warmup")))
    result["targets"] = check_targets(result["cases"])
    result["recomputed_by"] = f"python -m veloxquant_mlx.bench.gpu_speed --recompute {path}"
    report.write_json(result, path)
    return result


def main(argv=None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--recompute"]:
        if len(argv) != 2:
            raise SystemExit("usage: python -m veloxquant_mlx.bench.gpu_speed --recompute FILE.json")
        result = recompute(argv[1])
        print("\n".join(table_lines(result["cases"])))
        print(f"{len(result['cases'])} cases; rewrote {argv[1]}")
        return 0
    args = parse_args(argv)
    result = run(args)
    failed = [c for c in result["cases"] if c.get("error")]
    print("\n".join(table_lines(result["cases"])))
    print(f"{len(result['cases'])} cases, {len(failed)} failed; wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
