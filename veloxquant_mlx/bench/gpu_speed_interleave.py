"""gpu_speed --interleave: every spec's cache alive at once, decoded in rounds.

Why: decode tokens/s of one spec spread +-20-40% between repeats on the H200 (fp16 655 vs 381
tok/s in one run), because each spec's repeats run minutes apart and the machine drifts in
between; the targets are 0.9x / 1.0x of fp16, inside that noise. Here, at one context:
1. prefill: each spec's prompt is prefilled into a fresh cache (timed as in the plain mode,
   `repeats` times, interleaved over the specs); the last repeat's cache and logits are kept, so
   all specs' caches are alive together (an 8B-shaped fp16 cache of 8 layers is 4 GiB at 128K:
   fine on an H200). Peak memory is measured per prefill from mx.reset_peak_memory(): its
   `peak_over_start_bytes` is that prefill's own (the other caches are already in the start),
   `peak_bytes` includes the caches kept alive before it.
2. an untimed burst of `warmup_tokens` tokens per spec (the decode kernels' JIT compiles at this
   context).
3. `rounds` rounds: each runs every live spec for `round_tokens` greedy tokens back to back, in
   an order rotated by one spec each round (no spec always follows the same one), each token's
   interval recorded alone (bench/drive.py's pipelined decode: the next step is queued before a
   token is read; one more token is decoded and not timed, the burst's last, which has nothing
   queued behind it). A round's specs run within a second or so of each other, so a drift of the
   machine hits all of them alike; gpu_speed_figures turns each round into a ratio to fp16's
   interval in the same round.
A spec that fails (prefill, warm-up burst or a round) records its error; its earlier rounds
stay, it leaves the rounds, the others go on. The budget is checked before every prefill and
every round; rounds not run are recorded as skipped.

The dispatcher: our specs install the attention dispatcher when their patch opens
(integration/patch.py) and remove it when it closes; it routes by cache type (ours to
cache.attention, every other cache to mlx-lm's function untouched), so caches of different specs
can share one model as long as it stays installed. A cache remembers the dispatcher object that
last called it, and its update_and_fetch skips building the decoded K/V only while that object
is installed: a patch switched per round (measured on the CPU, 8 layers: 0.2 ms to open and close
a spec's patch) would install a NEW dispatcher each time, so each cache's first step after a
switch would build its decode graph again (measured on the CPU, kivi after a 1024-token prompt,
machine loaded: update_and_fetch 116 us with a stale dispatcher against 2.5 us with the installed
one, per layer: ~1 ms of host time in the first timed step of 8 layers after every switch).
`held_dispatcher` therefore keeps one reference to
the dispatcher for the whole context (dispatch.install counts references): every spec's patch
during the prefills and every round reuse that same object. fp16 and mlx-lm's caches then pass
through it: one isinstance check and one Python call per layer (0.8 us per call measured on the
CPU, 6 us per token for 8 layers, against a ~2 ms step on the H200).
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time

import mlx.core as mx

from veloxquant_mlx.bench.drive import decode, prefill


@contextlib.contextmanager
def held_dispatcher(model, specs):
    """Keep the attention dispatcher installed in the model's attention modules while open (if
    any spec is ours), so every cache of the context sees one dispatcher object."""
    ours = next((s for s in specs if s.kind in ("ours", "ablation")), None)
    if ours is None:
        yield []
        return
    from veloxquant_mlx.cache.builder import KVCacheBuilder
    from veloxquant_mlx.config import KVCacheConfig
    from veloxquant_mlx.integration import dispatch

    builder = KVCacheBuilder(model, KVCacheConfig.from_dict(ours.params))
    modules = dispatch.install(dispatch.module_names_of(builder.attention_modules))
    try:
        yield modules
    finally:
        dispatch.uninstall(modules)


def prefill_case(model, make_cache, prompt: mx.array, prefill_step_size: int):
    """A fresh cache list prefilled with `prompt` -> (run dict, cache list, last logits); the
    run has gpu_speed's prefill fields (decode ones None: decoding happens in rounds)."""
    gc.collect()
    mx.clear_cache()
    active_before = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = make_cache()
    start = time.perf_counter()
    logits = prefill(model, cache, prompt, prefill_step_size)
    prefill_s = time.perf_counter() - start
    run = {
        "context": int(prompt.size), "prefill_s": prefill_s, "prefill_tps": prompt.size / prefill_s,
        "decode_tps": None, "cache_bytes_after_prompt": int(sum(c.nbytes for c in cache)),
        "peak_bytes": int(mx.get_peak_memory()),
        "peak_over_start_bytes": int(mx.get_peak_memory() - active_before),
    }
    return run, cache, logits


def decode_burst(model, cache: list, logits: mx.array, tokens: int, profile=None):
    """`tokens` timed greedy tokens continuing from `logits` -> (intervals in ms, the logits to
    continue from, host ms per step: its graph built and handed to async_eval). Decodes tokens
    + 2: the last token is chosen but not fed (the next burst feeds it), and the last interval
    (nothing queued behind it) is not kept. `profile`: as drive.decode's."""
    trace = decode(model, cache, logits, tokens + 2, keep_logits=True, profile=profile)
    intervals = [1000 * s for s in trace.intervals()[:tokens]]
    return intervals, trace.logits[-1], [1000 * s for s in trace.host_s[:tokens]]


def run_context(model, specs, prompt, cases: dict, *, repeats: int, rounds: int, round_tokens: int,
                warmup_tokens: int, prefill_step_size: int, may_start, over_budget, save, log) -> None:
    """Interleaved prefills and decode rounds of every spec at one context, into `cases`
    (spec name -> the case dict of gpu_speed). `may_start(spec, case, what)` says whether a
    prefill may start (and records why not); `over_budget()` returns a reason text or None."""
    from veloxquant_mlx.bench.speed import _error_text

    live: dict[str, list] = {}  # spec name -> [cache list, logits to continue from]

    def fail(name: str, stage: str, exc: BaseException) -> None:
        cases[name]["error"] = f"{stage}: {_error_text(exc)}"
        log(f"  {name} error in {stage}: {cases[name]['error'][:200]}")
        live.pop(name, None)

    with held_dispatcher(model, specs):
        for repeat in range(repeats):
            for spec in specs:
                case = cases[spec.name]
                if not may_start(spec, case, f"prefill {repeat + 1} of {repeats}"):
                    continue
                live.pop(spec.name, None)  # the previous repeat's cache: freed before this one
                log(f"{spec.name} at {case['context']} prefill (repeat {repeat + 1}/{repeats})")
                try:
                    with spec.open(model) as make_cache:
                        run, cache, logits = prefill_case(model, make_cache, prompt, prefill_step_size)
                except Exception as exc:  # noqa: BLE001 - recorded; the other specs go on
                    fail(spec.name, f"prefill {repeat + 1}", exc)
                    continue
                case["runs"].append(run)
                live[spec.name] = [cache, logits]
                log(f"  prefill {run['prefill_s']:.2f} s, peak over start {run['peak_over_start_bytes'] / 2**30:.2f} GiB")
                save()
        for spec in specs:
            if spec.name in live:
                cases[spec.name]["interleaved"] = {"round_tokens": round_tokens, "rounds": []}
                try:
                    live[spec.name][1] = decode_burst(model, live[spec.name][0], live[spec.name][1],
                                                      warmup_tokens)[1]
                except Exception as exc:  # noqa: BLE001
                    fail(spec.name, "decode warm-up", exc)
        for r in range(rounds):
            names = [s.name for s in specs if s.name in live]
            if not names:
                break
            reason = over_budget()
            if reason:
                for name in names:
                    cases[name]["interleaved"]["skipped"] = f"{reason} (rounds {r + 1}-{rounds} of {rounds} not run)"
                break
            start = r % len(names)
            for position, name in enumerate(names[start:] + names[:start]):
                cache, logits = live[name]
                try:
                    intervals, live[name][1], host = decode_burst(model, cache, logits, round_tokens)
                except Exception as exc:  # noqa: BLE001
                    fail(name, f"decode round {r + 1}", exc)
                    continue
                cases[name]["interleaved"]["rounds"].append(
                    {"round": r, "position": position, "intervals_ms": intervals, "host_ms": host})
            log(f"  round {r + 1}/{rounds}: " + ", ".join(
                f"{n} {statistics.median(cases[n]['interleaved']['rounds'][-1]['intervals_ms']):.2f} ms"
                f" (host {statistics.median(cases[n]['interleaved']['rounds'][-1]['host_ms']):.2f})"
                for n in names if n in live))
            save()
    live.clear()
    gc.collect()
    mx.clear_cache()
