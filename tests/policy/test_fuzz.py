"""Fuzzed and mutated policies end in a PolicyError or a valid policy, never another exception;
a valid one then decides workloads or raises PolicyError (a gap), and lints without crashing."""

import pytest

from veloxquant_mlx import HardwareInfo, PolicyError, WorkloadSpec
from veloxquant_mlx.policy import decide, facts_of
from veloxquant_mlx.policy.lint import lint_policy
from tests.policy.fuzzing import compiled_or_none, mutated_policy, run_fuzz

PROBES = [
    facts_of(WorkloadSpec(128, 100), HardwareInfo()),
    facts_of(WorkloadSpec(256, 5000, 32, 4), HardwareInfo(2**35, 2**32)),
    facts_of(WorkloadSpec(512, 70_000, 32, 8), HardwareInfo(2**30, 2**29)),
]


def _run_case(seed: int) -> str:
    policy = compiled_or_none(mutated_policy(seed), seed)
    if policy is None:
        return "invalid"
    for facts in PROBES:
        try:
            decision = decide(policy, facts)
        except PolicyError as exc:
            assert "no rule matches" in str(exc)
            continue
        assert decision.config.method == policy.rules[[r.id for r in policy.rules].index(decision.rule_id)].method
    if seed % 10 == 0:
        try:
            lint_policy(policy)
        except PolicyError as exc:  # too many cells is the only refusal
            assert "cells" in str(exc)
    return "valid"


def _run(seeds) -> dict:
    return run_fuzz(seeds, _run_case, mutated_policy)


def test_fuzz_fast():
    outcomes = _run(range(300))
    # Both outcomes must occur, or the mutations are not exercising anything.
    assert outcomes["invalid"] > 50 and outcomes["valid"] > 10, outcomes


@pytest.mark.slow
def test_fuzz_10000():
    outcomes = _run(range(1000, 11_000))
    assert sum(outcomes.values()) == 10_000
    assert outcomes["invalid"] > 1000 and outcomes["valid"] > 100, outcomes
