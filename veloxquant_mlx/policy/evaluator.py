"""Stage 4: evaluate a compiled policy on a fact dict. Pure, no I/O, microseconds.

Rules are tried in order and the first whose condition holds chooses the method and its
parameters. Then every adjustment whose condition holds and that names the chosen method sets
its parameters for that method, in the order the adjustments are written (a later one wins on
the same parameter). No rule matching is a PolicyError: lint proves a policy cannot get there.
"""

from __future__ import annotations

from veloxquant_mlx.errors import PolicyError
from veloxquant_mlx.policy.compiler import CompiledPolicy
from veloxquant_mlx.policy.decision import Decision
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


def _outcome_text(policy: CompiledPolicy, rule, applied: tuple) -> str:
    """", so METHOD with PARAMS" for a rule and the adjustments applied: the same for every
    decision with that (rule, adjustments), so it is built once and kept."""
    key = ("text", rule.index, applied)
    text = policy.config_cache.get(key)
    if text is None:
        params = dict(rule.params)
        for index in applied:
            params.update(policy.adjustments[index].sets[rule.method])
        text = f", so {rule.method}" + (f" with {_params_text(params)}" if params else "")
        policy.config_cache[key] = text
    return text


def decide(policy: CompiledPolicy, facts: dict) -> Decision:
    """The decision for one fact dict, with its trail (see Decision). The facts dict is kept
    by the decision: do not mutate it afterwards."""
    for rule in policy.rules:
        if rule.test(facts):
            break
    else:
        shown = ", ".join(f"{k}={v}" for k, v in facts.items())
        raise PolicyError(f"{policy.source}: policy {policy.name} v{policy.version}: no rule matches "
                          f"the workload ({shown}); `veloxquant policy lint` lists such gaps")
    method = rule.method
    matched = []
    applied = []
    adj_reasons = ""
    for adj in policy.adjustments:
        held = adj.test(facts)
        matched.append(held)
        if held and method in adj.sets:
            applied.append(adj.index)
            adj_reasons += f"; adjustment {adj.id}: {render(adj.reason, facts)}"
    applied = tuple(applied)
    config = policy.config_for(rule.index, applied)
    reason = (f"Policy {policy.name} v{policy.version}, rule {rule.id}: {render(rule.reason, facts)}"
              f"{_outcome_text(policy, rule, applied)}{adj_reasons}.")
    return Decision(policy, rule.index, tuple(matched), config, reason, facts)
