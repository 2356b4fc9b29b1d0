"""A decision and its trail: which policy, which rules were tried, what they saw."""

from __future__ import annotations

from typing import NamedTuple

from veloxquant_mlx.config.kv_cache_config import KVCacheConfig

# NamedTuples, not frozen dataclasses: immutable too, and several times cheaper to build,
# which matters because every decision builds one per rule tried (20 us budget per decision).


class RuleTrace(NamedTuple):
    """One rule as the evaluator tried it, with the values of the facts it reads."""

    rule_id: str
    matched: bool
    facts: dict

    def to_dict(self) -> dict:
        return {"rule": self.rule_id, "matched": self.matched, "facts": dict(self.facts)}


class AdjustmentTrace(NamedTuple):
    """One adjustment: whether its condition held, and what it set on the chosen method
    (empty when it held but does not name that method)."""

    adjustment_id: str
    matched: bool
    applied: dict
    facts: dict

    def to_dict(self) -> dict:
        return {"adjustment": self.adjustment_id, "matched": self.matched,
                "applied": dict(self.applied), "facts": dict(self.facts)}


class Decision(NamedTuple):
    """What a policy decided for one fact dict. Only what the evaluator learnt is stored (the
    rule that matched, which adjustment conditions held); the trail is derived from it on
    access: with first-match semantics every rule before the chosen one was tried and did not
    match, and the facts each saw are the decision's facts."""

    policy: object  # the CompiledPolicy
    rule_index: int
    adjustments_matched: tuple  # one bool per adjustment, in order
    config: KVCacheConfig
    reason: str
    facts: dict

    @property
    def policy_name(self) -> str:
        return self.policy.name

    @property
    def policy_version(self) -> int:
        return self.policy.version

    @property
    def policy_sha256(self) -> str:
        return self.policy.sha256

    @property
    def policy_source(self) -> str:
        return self.policy.source

    @property
    def rule_id(self) -> str:
        return self.policy.rules[self.rule_index].id

    @property
    def rules(self) -> tuple:
        """RuleTrace for every rule tried, in order: all before the chosen one, which matched."""
        facts = self.facts
        return tuple(RuleTrace(rule.id, rule.index == self.rule_index, {n: facts[n] for n in rule.facts})
                     for rule in self.policy.rules[:self.rule_index + 1])

    @property
    def adjustments(self) -> tuple:
        facts = self.facts
        method = self.config.method
        return tuple(
            AdjustmentTrace(adj.id, matched, dict(adj.sets.get(method, {})) if matched else {},
                            {n: facts[n] for n in adj.facts})
            for adj, matched in zip(self.policy.adjustments, self.adjustments_matched))

    def to_dict(self) -> dict:
        return {
            "policy": {"name": self.policy_name, "version": self.policy_version,
                       "sha256": self.policy_sha256, "source": self.policy_source},
            "rule": self.rule_id,
            "config": self.config.to_dict(),
            "reason": self.reason,
            "rules": [trace.to_dict() for trace in self.rules],
            "adjustments": [trace.to_dict() for trace in self.adjustments],
            "facts": dict(self.facts),
        }

    def explain(self) -> str:
        """The trail as readable lines (the CLI's --explain)."""
        lines = [f"policy {self.policy_name} v{self.policy_version} ({self.policy_source}, "
                 f"sha256 {self.policy_sha256[:16]}...)"]
        lines.append("facts: " + ", ".join(f"{k}={_show(v)}" for k, v in self.facts.items()))
        for trace in self.rules:
            mark = "MATCH" if trace.matched else "no"
            seen = ", ".join(f"{k}={_show(v)}" for k, v in trace.facts.items())
            lines.append(f"  rule {trace.rule_id}: {mark} ({seen})")
        for trace in self.adjustments:
            if trace.applied:
                state = "applied " + ", ".join(f"{k}={v}" for k, v in trace.applied.items())
            elif trace.matched:
                state = f"held, but does not name {self.config.method}"
            else:
                state = "no"
            seen = ", ".join(f"{k}={_show(v)}" for k, v in trace.facts.items())
            lines.append(f"  adjustment {trace.adjustment_id}: {state} ({seen})")
        lines.append("config: " + ", ".join(f"{k}={v}" for k, v in self.config.to_dict().items()))
        lines.append(f"reason: {self.reason}")
        return "\n".join(lines)


def _show(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
