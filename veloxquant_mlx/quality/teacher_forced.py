"""Run a model over a token sequence with a given cache: one prefill, then one token per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx


@dataclass(frozen=True)
class TeacherForcedRun:
    """Log-probabilities the model gave, row i predicting token i + 1 of the sequence.

    ``logprobs`` has shape (n_tokens - 1, vocab), float32; rows [n_prefill - 1, n_tokens - 1)
    come from the decode steps and the prefill's last position (the "decoded positions").
    """

    logprobs: mx.array
    n_prefill: int
    nbytes_after_prompt: int
    nbytes_after_run: int


def _cache_nbytes(cache: list) -> int:
    return int(sum(c.nbytes for c in cache))


def teacher_forced_run(model, tokens: Sequence[int], cache: list, n_prefill: int) -> TeacherForcedRun:
    """Prefill ``tokens[:n_prefill]`` in one call, then feed the true tokens one at a time.

    Teacher forcing: step t feeds ``tokens[t]`` whatever the model predicted, so the reference
    and the cache under test see the same context and their distributions are comparable.
    The log-probabilities are evaluated every step so the graph (and the cache's lazily
    computed arrays) never spans more than one token.
    """
    n = len(tokens)
    if not 1 <= n_prefill < n:
        raise ValueError(f"n_prefill is {n_prefill}; allowed: 1 <= n_prefill < len(tokens) = {n}")
    ids = mx.array(list(tokens), dtype=mx.int32)[None]
    logits = model(ids[:, :n_prefill], cache=cache)
    rows = [_log_softmax(logits[0])]
    mx.eval(rows[-1])  # nbytes is shape-based: no need to evaluate the caches' own state
    nbytes_prompt = _cache_nbytes(cache)
    for t in range(n_prefill, n - 1):
        logits = model(ids[:, t : t + 1], cache=cache)
        rows.append(_log_softmax(logits[0]))
        mx.eval(rows[-1])
    logprobs = mx.concatenate(rows, axis=0)
    mx.eval(logprobs)
    return TeacherForcedRun(logprobs, n_prefill, nbytes_prompt, _cache_nbytes(cache))


def _log_softmax(logits: mx.array) -> mx.array:
    logits = logits.astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)
