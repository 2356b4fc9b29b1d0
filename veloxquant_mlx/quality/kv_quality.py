"""The DESIGN.md quality protocol: a cache under test against an unquantized KVCache.

Real model in float32 on the CPU, a fixed passage of real prose (the first 512 tokens),
prefill 128 tokens, then decode the rest one token at a time teacher-forced; at each decoded
position compare the next-token distribution with the reference's: KL(ref || q), top-1
agreement; and the perplexity of the true text under both.

The cache under test comes from ``make_cache(model) -> list`` (one cache per layer, any
object implementing the mlx-lm cache contract, e.g. ``[QuantizedKVCache(64, 4) for _ in
model.layers]``). Caches that need an attention patch (ours, DESIGN.md) must have it
installed by the caller; this module only calls ``model(tokens, cache=...)``.

For speed on the Linux CPU preload OpenBLAS (FACTS.md):
``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0`` -- fp32 matmul
~30x faster; nothing here requires it.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .result import QualityResult
from .teacher_forced import TeacherForcedRun, teacher_forced_run

N_TOKENS = 512
N_PREFILL = 128


def reference_cache(model) -> list:
    """The unquantized reference: one mlx-lm KVCache per layer (keeps the model's dtype)."""
    return [KVCache() for _ in model.layers]


def reference_run(model, tokens: Sequence[int], n_prefill: int = N_PREFILL) -> TeacherForcedRun:
    """The reference pass, to share between several ``measure_kv_quality`` calls."""
    return teacher_forced_run(model, tokens, reference_cache(model), n_prefill)


def measure_kv_quality(
    model,
    tokens: Sequence[int],
    make_cache: Callable[[object], list],
    n_prefill: int = N_PREFILL,
    reference: Optional[TeacherForcedRun] = None,
) -> QualityResult:
    """KL, top-1 and PPL of the cache ``make_cache(model)`` against the unquantized KVCache.

    ``tokens``: the passage (e.g. ``passage_tokens(tokenizer)``, 512 tokens); positions
    ``n_prefill .. len(tokens)`` are the decoded ones (``len(tokens) - n_prefill`` of them, the
    first predicted by the prefill's last position). ``reference``: a ``reference_run`` of the
    same model, tokens and n_prefill, to skip recomputing it.
    """
    if reference is None:
        reference = reference_run(model, tokens, n_prefill)
    elif reference.n_prefill != n_prefill or reference.logprobs.shape[0] != len(tokens) - 1:
        raise ValueError(
            f"reference was run with n_prefill={reference.n_prefill} over {reference.logprobs.shape[0] + 1} tokens; "
            f"this call has n_prefill={n_prefill} over {len(tokens)} tokens"
        )
    cache = make_cache(model)
    if len(cache) != len(model.layers):
        raise ValueError(f"make_cache returned {len(cache)} caches; the model has {len(model.layers)} layers")
    run = teacher_forced_run(model, tokens, cache, n_prefill)

    targets = mx.array(list(tokens[1:]), dtype=mx.int32)[:, None]
    d = slice(n_prefill - 1, None)  # rows of the decoded positions
    ref_lp, q_lp = reference.logprobs[d], run.logprobs[d]
    kl = mx.sum(mx.exp(ref_lp) * (ref_lp - q_lp), axis=-1)
    agree = mx.argmax(ref_lp, axis=-1) == mx.argmax(q_lp, axis=-1)
    nll = -mx.take_along_axis(run.logprobs, targets, axis=-1).mean()
    nll_ref = -mx.take_along_axis(reference.logprobs, targets, axis=-1).mean()
    mx.eval(kl, agree, nll, nll_ref)
    # Rounding can make a KL of identical distributions a hair negative: clamp at 0.
    kl_values = sorted(max(0.0, v) for v in kl.tolist())
    return QualityResult(
        kl_mean=sum(kl_values) / len(kl_values),
        kl_median=_median(kl_values),
        kl_max=kl_values[-1],
        top1=float(agree.astype(mx.float32).mean().item()),
        ppl=math.exp(nll.item()),
        ppl_ref=math.exp(nll_ref.item()),
        n_positions=len(kl_values),
        n_prefill=n_prefill,
        n_tokens=len(tokens),
        nbytes_after_prompt=run.nbytes_after_prompt,
        nbytes_after_run=run.nbytes_after_run,
        nbytes_ref_after_prompt=reference.nbytes_after_prompt,
        nbytes_ref_after_run=reference.nbytes_after_run,
    )


def _median(sorted_values: list) -> float:
    m = len(sorted_values) // 2
    if len(sorted_values) % 2:
        return sorted_values[m]
    return 0.5 * (sorted_values[m - 1] + sorted_values[m])
