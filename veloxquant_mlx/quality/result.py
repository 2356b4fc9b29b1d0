"""The outcome of one KV-cache quality measurement."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class QualityResult:
    """A cache under test against the unquantized reference, on one passage.

    kl_mean / kl_median / kl_max: KL(ref || q) of the next-token distributions, in nats, over
    the ``n_positions`` decoded positions. top1: fraction of those positions where both argmaxes
    agree (0..1). ppl / ppl_ref: perplexity of the true text over every predicted token of the
    passage (prefill and decode, ``n_tokens - 1`` predictions) with the cache under test / the
    reference. nbytes_*: sum of the caches' ``nbytes`` after the prefill and after the last
    decode step (growth slack included, as each cache reports it).
    """

    kl_mean: float
    kl_median: float
    kl_max: float
    top1: float
    ppl: float
    ppl_ref: float
    n_positions: int
    n_prefill: int
    n_tokens: int
    nbytes_after_prompt: int
    nbytes_after_run: int
    nbytes_ref_after_prompt: int
    nbytes_ref_after_run: int

    def to_dict(self) -> dict:
        return asdict(self)
