"""Stage 4: evaluate a compiled policy on a fact dict. Pure, no I/O, microseconds.

Rules are tried in order and the first whose condition holds chooses the method and its
parameters. Then every adjustment whose condition holds and that names the chosen method sets
its parameters for that method, in the order the adjustments are written (a later one wins on
the same parameter). No rule matching is a PolicyError: lint proves a policy cannot get there.
"""

from __future__ import annotations

from veloxquant_mlx.errors import PolicyError
from veloxquant_mlx.policy.compiler import CompiledPolicy
from veloxquant_mlx.policy.decision import AdjustmentTrace, Decision, RuleTrace
from veloxquant_mlx.policy.templates import render


def choose(policy: CompiledPolicy, facts: dict):
    """(rule, applied adjustment indices) without building a trail; None if no rule matches.
    Lint, simulate and diff use it over many cells."""
    for rule in policy.rules:
        if rule.test(facts):
            applied = tuple(adj.index for adj in policy.adjustments
                            if rule.method in adj.sets and adj.test(facts))
            return rule, applied
    return None


def _params_text(params: dict) -> str:
    return ", ".join(f"{k}={list(v) if isinstance(v, tuple) else v}" for k, v in params.items())


def decide(policy: CompiledPolicy, facts: dict) -> Decision:
    traces = []
    chosen = None
    for rule in policy.rules:
        matched = rule.test(facts)
        traces.append(RuleTrace(rule.id, matched, {name: facts[name] for name in rule.facts}))
        if matched:
            chosen = rule
            break
    if chosen is None:
        shown = ", ".join(f"{k}={v}" for k, v in facts.items())
        raise PolicyError(f"{policy.source}: policy {policy.name} v{policy.version}: no rule matches "
                          f"the workload ({shown}); `veloxquant policy lint` lists such gaps")
    method = chosen.method
    adj_traces = []
    applied = []
    set_params = dict(chosen.params)
    adj_reasons = []
    for adj in policy.adjustments:
        matched = adj.test(facts)
        sets = adj.sets.get(method) if matched else None
        if sets:
            applied.append(adj.index)
            set_params.update(sets)
            adj_reasons.append(f"adjustment {adj.id}: {render(adj.reason, facts)}")
        adj_traces.append(AdjustmentTrace(adj.id, matched, dict(sets or {}),
                                          {name: facts[name] for name in adj.facts}))
    config = policy.config_for(chosen.index, tuple(applied))
    reason = (f"Policy {policy.name} v{policy.version}, rule {chosen.id}: "
              f"{render(chosen.reason, facts)}, so {method}"
              + (f" with {_params_text(set_params)}" if set_params else "")
              + "".join(f"; {text}" for text in adj_reasons) + ".")
    return Decision(policy.name, policy.version, policy.sha256, policy.source, chosen.id, config,
                    reason, tuple(traces), tuple(adj_traces), facts)
