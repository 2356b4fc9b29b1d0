"""Prefill and decode speed over a list of context lengths, against fp16 in the same run.

One case = a fresh cache list, the prompt of `context` tokens prefilled in chunks (timed), then
`warmup_tokens + decode_tokens + 2` greedy tokens; decode tokens/s is 1 / the median per-token
interval over the `decode_tokens` timed tokens (the warm-up tokens absorb a first call's
compilation and the allocator's growth; the last token is decoded but not timed, as nothing is
queued behind it). Each spec first runs one untimed warm-up case at the smallest context.
Repeats are interleaved across specs (spec A, B, C, then A, B, C again) so a change of load on a
shared machine hits every spec alike; each figure is the median over repeats with its min and
max. Ratios divide a spec's median by the fp16 KVCache's (and by each mlx-lm QuantizedKVCache's)
median at the same context.

The prompt is random token ids from a fixed seed: speed does not depend on which tokens they
are (quality is measured on real text by the quality module).
"""

from __future__ import annotations

import gc
import statistics
import time
import traceback

import mlx.core as mx

from veloxquant_mlx.bench.drive import decode, prefill
from veloxquant_mlx.bench.progress import Progress


def random_prompt(vocab_size: int, tokens: int, seed: int = 0) -> mx.array:
    return mx.random.randint(0, vocab_size, (tokens,), key=mx.random.key(seed)).astype(mx.int32)


def vocab_size_of(model) -> int:
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if size:
        return int(size)
    return int(model.model.embed_tokens.weight.shape[0])


def measure_case(model, make_cache, prompt: mx.array, *, decode_tokens: int, warmup_tokens: int,
                 prefill_step_size: int = 2048) -> dict:
    """One prefill + decode on a fresh cache; times, bytes and peak memory."""
    gc.collect()
    mx.clear_cache()
    active_before = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = make_cache()
    start = time.perf_counter()
    logits = prefill(model, cache, prompt, prefill_step_size)
    prefill_s = time.perf_counter() - start
    cache_bytes = int(sum(c.nbytes for c in cache))
    # One token past the timed ones: the last token read has no next step queued behind it, so
    # its interval is not steady state (measured 15 ms against 77 ms for the others on the CPU);
    # it is decoded but never timed.
    trace = decode(model, cache, logits, warmup_tokens + decode_tokens + 2)
    intervals = trace.intervals(skip=warmup_tokens)[:decode_tokens]
    median_interval = statistics.median(intervals) if intervals else float("nan")
    result = {
        "context": int(prompt.size),
        "prefill_s": prefill_s,
        "prefill_tps": prompt.size / prefill_s,
        "decode_tps": 1.0 / median_interval if intervals else None,
        "decode_tps_mean": len(intervals) / sum(intervals) if intervals else None,
        "decode_interval_ms_median": 1000 * median_interval,
        "decode_interval_ms_min": 1000 * min(intervals) if intervals else None,
        "decode_interval_ms_max": 1000 * max(intervals) if intervals else None,
        "decoded_tokens_timed": len(intervals),
        "cache_bytes_after_prompt": cache_bytes,
        "peak_bytes": int(mx.get_peak_memory()),
        "peak_over_start_bytes": int(mx.get_peak_memory() - active_before),
    }
    del cache, logits, trace
    gc.collect()
    mx.clear_cache()
    return result


def _summary(values: list[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def run_speed(model, specs, contexts, *, repeats: int = 3, decode_tokens: int = 16,
              warmup_tokens: int = 2, prefill_step_size: int = 2048, seed: int = 0,
              progress: bool = True) -> dict:
    """Speed of every spec at every context; returns {"cases": [...], "settings": {...}}."""
    contexts = sorted(int(c) for c in contexts)
    vocab = vocab_size_of(model)
    prompts = {c: random_prompt(vocab, c, seed) for c in contexts}
    runs: dict[tuple[str, int], list[dict]] = {}
    errors: dict[tuple[str, int], str] = {}
    total = len(specs) * (1 + repeats * len(contexts))
    with Progress(total, "speed", enabled=progress) as bar:
        for spec in specs:  # warm-up: compile and grow the allocator once per spec
            bar.set_postfix_str(f"warm-up {spec.name}")
            try:
                with spec.open(model) as make_cache:
                    measure_case(model, make_cache, prompts[contexts[0]], decode_tokens=2,
                                 warmup_tokens=1, prefill_step_size=prefill_step_size)
            except Exception as exc:  # noqa: BLE001 - recorded per case below, run continues
                for c in contexts:
                    errors[(spec.name, c)] = f"warm-up failed: {_error_text(exc)}"
            bar.update()
        for _ in range(repeats):
            for context in contexts:
                for spec in specs:
                    bar.set_postfix_str(f"{spec.name} @ {context}")
                    if (spec.name, context) in errors:
                        bar.update()
                        continue
                    try:
                        with spec.open(model) as make_cache:
                            run = measure_case(model, make_cache, prompts[context],
                                               decode_tokens=decode_tokens,
                                               warmup_tokens=warmup_tokens,
                                               prefill_step_size=prefill_step_size)
                        runs.setdefault((spec.name, context), []).append(run)
                    except Exception as exc:  # noqa: BLE001 - one failing case must not end the run
                        errors[(spec.name, context)] = _error_text(exc)
                    bar.update()
    cases = []
    for context in contexts:
        for spec in specs:
            key = (spec.name, context)
            case = {"spec": spec.name, "label": spec.label, "kind": spec.kind, "context": context}
            if key in errors:
                case["error"] = errors[key]
            reps = runs.get(key, [])
            case["runs"] = reps
            for metric in ("prefill_tps", "decode_tps", "prefill_s", "peak_bytes",
                           "peak_over_start_bytes", "cache_bytes_after_prompt"):
                case[metric] = _summary([r[metric] for r in reps])
            cases.append(case)
    _add_ratios(cases, specs)
    return {
        "settings": {
            "contexts": contexts, "repeats": repeats, "decode_tokens": decode_tokens,
            "warmup_tokens": warmup_tokens, "prefill_step_size": prefill_step_size, "seed": seed,
            "prompt": "random token ids (speed does not depend on them)",
        },
        "cases": cases,
    }


def _add_ratios(cases: list[dict], specs) -> None:
    """ratio_vs[reference][metric] = this median / the reference's median, same context."""
    references = [s.name for s in specs if s.kind in ("fp16", "mlx-quantized")]
    by_key = {(c["spec"], c["context"]): c for c in cases}
    for case in cases:
        case["ratio_vs"] = {}
        for ref in references:
            other = by_key.get((ref, case["context"]))
            # Every spec against fp16; only ours against mlx-lm's quantized caches too.
            if other is None or ref == case["spec"] or (other["kind"] != "fp16" and case["kind"] != "ours"):
                continue
            ratios = {}
            for metric in ("prefill_tps", "decode_tps"):
                mine, theirs = case[metric]["median"], other[metric]["median"]
                ratios[metric] = mine / theirs if mine and theirs else None
            case["ratio_vs"][ref] = ratios


def _error_text(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename.split('/')[-1]}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {str(exc)[:600]}{where}"
