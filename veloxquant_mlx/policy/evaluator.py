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
from veloxquant_mlx.policy.layers import show_value
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


def _params_text_v2(params: dict, config) -> str:
    """v2: the values the decision resolved (a layer profile as its per-layer list, compact)."""
    return ", ".join(f"{k}={show_value(getattr(config, k))}" for k in params)


def _outcome_text(policy: CompiledPolicy, rule, applied: tuple, config, n_layers) -> str:
    """", so METHOD with PARAMS" for a rule and the adjustments applied: the same for every
    decision with that (rule, adjustments) -- and n_layers, when a layer profile resolves
    differently per depth -- so it is built once and kept."""
    layered = policy.depends_on_layers(rule.index, applied)
    key = ("text", rule.index, applied, n_layers) if layered else ("text", rule.index, applied)
    text = policy.config_cache.get(key)
    if text is None:
        params = policy.merged_params(rule.index, applied)
        shown = _params_text(params) if policy.version < 2 else _params_text_v2(params, config)
        text = f", so {rule.method}" + (f" with {shown}" if params else "")
        if layered and len(policy.config_cache) > 4096:  # bounded: one entry per depth seen
            for old in [k for k in policy.config_cache if len(k) == 4 and k[0] == "text"]:
                del policy.config_cache[old]
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
    n_layers = facts["n_layers"]
    config = policy.config_for(rule.index, applied, n_layers)
    reason = (f"Policy {policy.name} v{policy.version}, rule {rule.id}: {render(rule.reason, facts)}"
              f"{_outcome_text(policy, rule, applied, config, n_layers)}{adj_reasons}.")
    return Decision(policy, rule.index, tuple(matched), config, reason, facts)
