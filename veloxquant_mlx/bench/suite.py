"""The whole benchmark: quality, memory and speed for a list of cache specs, in one result."""

from __future__ import annotations

import time

from veloxquant_mlx.bench.memory import measure_memory
from veloxquant_mlx.bench.progress import Progress
from veloxquant_mlx.bench.speed import random_prompt, run_speed, vocab_size_of, _error_text


def run_memory(model, specs, contexts, *, prefill_step_size: int = 2048, seed: int = 0,
               progress: bool = True) -> list[dict]:
    vocab = vocab_size_of(model)
    rows = []
    with Progress(len(specs) * len(contexts), "memory", enabled=progress) as bar:
        for context in sorted(set(contexts)):
            prompt = random_prompt(vocab, context, seed)
            for spec in specs:
                bar.set_postfix_str(f"{spec.name} @ {context}")
                row = {"spec": spec.name, "label": spec.label, "kind": spec.kind, "context": context}
                try:
                    with spec.open(model) as make_cache:
                        row.update(measure_memory(model, make_cache, prompt, prefill_step_size))
                except Exception as exc:  # noqa: BLE001 - recorded, the run continues
                    row["error"] = _error_text(exc)
                rows.append(row)
                bar.update()
    return rows


def run_suite(model, tokenizer, specs, *, parts, contexts, memory_contexts, repeats,
              decode_tokens, warmup_tokens, prefill_step_size, seed=0, progress=True,
              on_part_done=None) -> dict:
    """Run the requested parts ("quality", "memory", "speed"); returns their results and the
    seconds each took. `on_part_done(result)` is called after each part (to save partial work)."""
    result: dict = {"timings_s": {}}
    if "quality" in parts:
        start = time.perf_counter()
        if tokenizer is None:
            result["quality"] = []
            result["quality_skipped"] = "random-weight model: the quality protocol needs the real model"
        else:
            from veloxquant_mlx.bench.quality import run_quality

            result["quality"] = run_quality(model, tokenizer, specs, progress=progress)
        result["timings_s"]["quality"] = time.perf_counter() - start
        if on_part_done:
            on_part_done(result)
    if "memory" in parts:
        start = time.perf_counter()
        result["memory"] = run_memory(model, specs, memory_contexts,
                                      prefill_step_size=prefill_step_size, seed=seed, progress=progress)
        result["timings_s"]["memory"] = time.perf_counter() - start
        if on_part_done:
            on_part_done(result)
    if "speed" in parts:
        start = time.perf_counter()
        result["speed"] = run_speed(model, specs, contexts, repeats=repeats,
                                    decode_tokens=decode_tokens, warmup_tokens=warmup_tokens,
                                    prefill_step_size=prefill_step_size, seed=seed, progress=progress)
        result["timings_s"]["speed"] = time.perf_counter() - start
        if on_part_done:
            on_part_done(result)
    return result
