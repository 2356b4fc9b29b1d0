"""Fuzzed and mutated v2 policies (v1's mutations plus random layer profiles put into params)
end in a PolicyError naming the file or a valid policy, never another exception; a valid one
decides workloads of several depths (or raises PolicyError: a gap or a list that does not fit)
and lints without crashing."""

import pytest

from veloxquant_mlx import HardwareInfo, PolicyError, WorkloadSpec
from veloxquant_mlx.policy import decide, facts_of
from veloxquant_mlx.policy.diff import diff_policies
from veloxquant_mlx.policy.lint import lint_policy
from veloxquant_mlx.policy.sources import default_policy_path, load_policy
from tests.policy.fuzzing import compiled_or_none, mutated_policy_v2, run_fuzz

V2_TEXT = default_policy_path(2).read_text(encoding="utf-8")
PROBES = [
    facts_of(WorkloadSpec(128, 100, 1), HardwareInfo()),
    facts_of(WorkloadSpec(128, 4096, 3), HardwareInfo()),
    facts_of(WorkloadSpec(256, 5000, 32, 4), HardwareInfo(2**35, 2**32)),
    facts_of(WorkloadSpec(512, 70_000, 80, 8), HardwareInfo(2**30, 2**29)),
]


def _run_case(seed: int) -> str:
    policy = compiled_or_none(mutated_policy_v2(seed, V2_TEXT), seed)
    if policy is None:
        return "invalid"
    for facts in PROBES:
        try:
            decision = decide(policy, facts)
        except PolicyError as exc:
            assert "no rule matches" in str(exc) or "entries but the workload has n_layers" in str(exc), str(exc)
            continue
        bits = getattr(decision.config, "bit_width_inlier", None)
        if isinstance(bits, tuple):
            assert len(bits) == facts["n_layers"]
        decision.to_dict()
    if seed % 10 == 0:
        try:
            lint_policy(policy)
            if policy.version == 2:
                diff_policies(load_policy(default_policy_path(2)), policy)
        except PolicyError as exc:  # too many cells is the only refusal
            assert "cells" in str(exc)
    return "valid"


def _run(seeds) -> dict:
    return run_fuzz(seeds, _run_case, lambda seed: mutated_policy_v2(seed, V2_TEXT))


def test_fuzz_v2_fast():
    outcomes = _run(range(200))
    assert outcomes["invalid"] > 30 and outcomes["valid"] > 10, outcomes


@pytest.mark.slow
def test_fuzz_v2_10000():
    outcomes = _run(range(1000, 11_000))
    assert sum(outcomes.values()) == 10_000
    assert outcomes["invalid"] > 1000 and outcomes["valid"] > 100, outcomes
