"""Wall-clock timing of MLX work on a shared machine: one helper for every measurement module.

MLX is lazy, so a timed call must evaluate what it builds: `time_calls` runs `mx.eval` on each
call's result inside the timed interval. Several candidates are timed in interleaved rounds
(A, B, C, then A, B, C again) so a change of load on a shared machine hits all of them alike;
`summarize` reports the median with its spread (min, quartiles, max), never a single figure.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import mlx.core as mx


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """(seconds, result) of one call of `fn`, its result evaluated inside the interval."""
    start = time.perf_counter()
    result = fn()
    if result is not None:
        mx.eval(result)
    return time.perf_counter() - start, result


def time_calls(candidates: dict[str, Callable[[], object]], *, rounds: int,
               warmup: int = 1) -> dict[str, list[float]]:
    """Seconds of each call of each candidate: `warmup` untimed calls each (compilation, the
    allocator's growth), then `rounds` interleaved rounds of one call per candidate."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds!r} is invalid: allowed is an integer >= 1")
    for fn in candidates.values():
        for _ in range(warmup):
            timed(fn)
    seconds: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(rounds):
        for name, fn in candidates.items():
            seconds[name].append(timed(fn)[0])
    return seconds


def summarize(seconds: list[float], unit: float = 1.0) -> dict:
    """min, p25, median, p75, max and n of `seconds` (divided by `unit`: 1e-3 gives ms)."""
    if not seconds:
        return {"min": None, "p25": None, "median": None, "p75": None, "max": None, "n": 0}
    values = sorted(s / unit for s in seconds)
    if len(values) > 1:
        p25, _, p75 = statistics.quantiles(values, n=4, method="inclusive")
    else:
        p25 = p75 = values[0]
    return {"min": values[0], "p25": p25, "median": statistics.median(values), "p75": p75,
            "max": values[-1], "n": len(values)}
