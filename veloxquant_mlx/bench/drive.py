"""Run a model over a cache the way mlx-lm's `generate_step` does, with timestamps.

Prefill: the prompt minus its last token in chunks of `prefill_step_size` (2048, mlx-lm's
default), evaluating the cache state after each chunk and clearing MLX's buffer cache; then the
last token gives the first logits. Decode: greedy, one token at a time, with the next step
queued (`mx.async_eval`) before the current token is read, so the per-token interval is the
steady-state throughput mlx-lm reports as generation tokens/s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx


def cache_arrays(cache: list) -> list:
    # A cache's state may hold non-array entries (our caches keep a JSON meta string).
    from mlx.utils import tree_flatten

    return [a for c in cache for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]


def prefill(model, cache: list, prompt: mx.array, prefill_step_size: int = 2048) -> mx.array:
    """Feed `prompt` (1-D token ids) into `cache`; return the last position's logits (1, V)."""
    if prompt.ndim != 1 or prompt.size < 1:
        raise ValueError(f"prefill needs a 1-D prompt of at least one token, got shape {prompt.shape}")
    if prefill_step_size < 1:
        raise ValueError(f"prefill_step_size={prefill_step_size!r} is invalid: allowed is >= 1")
    start = 0
    while prompt.size - start > 1:
        n = min(prefill_step_size, prompt.size - start - 1)
        model(prompt[start : start + n][None], cache=cache)
        mx.eval(cache_arrays(cache))
        start += n
        mx.clear_cache()
    logits = model(prompt[start:][None], cache=cache)[:, -1, :]
    mx.eval(logits)
    return logits


@dataclass
class DecodeTrace:
    tokens: list[int] = field(default_factory=list)
    logits: list = field(default_factory=list)  # per token, when kept
    times: list[float] = field(default_factory=list)  # perf_counter when each token was read
    # Host seconds per queued step: building its graph (the model call) and handing it to
    # async_eval, which encodes the launches. A step whose host time is its whole interval is
    # bound by the host, not by the device's kernels.
    host_s: list[float] = field(default_factory=list)

    def intervals(self, skip: int = 0) -> list[float]:
        t = self.times[skip:]
        return [b - a for a, b in zip(t, t[1:])]


def decode(model, cache: list, logits: mx.array, n_tokens: int, *, keep_logits: bool = False,
           forced_tokens: list[int] | None = None, profile=None) -> DecodeTrace:
    """Greedy decode `n_tokens` tokens from `logits` (the prefill's). With `forced_tokens`,
    feed those instead of the argmax (teacher forcing, for comparing caches on the same path).
    `profile` (a cProfile.Profile, or None): enabled around each step's host part only, the span
    `host_s` times (bench/host_profile.py)."""
    trace = DecodeTrace()
    if n_tokens < 1:
        return trace

    def choose(step_logits, i):
        if forced_tokens is not None:
            return mx.array([forced_tokens[i]])
        return mx.argmax(step_logits, axis=-1)

    y = choose(logits, 0)
    current_logits = logits
    mx.async_eval(y)
    for i in range(n_tokens):
        if i + 1 < n_tokens:
            built = time.perf_counter()
            if profile is not None:
                profile.enable()
            next_logits = model(y[None], cache=cache)[:, -1, :]
            next_y = choose(next_logits, i + 1)
            mx.async_eval(next_y, next_logits)
            if profile is not None:
                profile.disable()
            trace.host_s.append(time.perf_counter() - built)
        trace.tokens.append(int(y.item()))
        trace.times.append(time.perf_counter())
        if keep_logits:
            trace.logits.append(current_logits)
        if i + 1 < n_tokens:
            y, current_logits = next_y, next_logits
    return trace
