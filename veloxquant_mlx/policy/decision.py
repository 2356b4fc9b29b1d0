"""A decision and its trail: which policy, which rules were tried, what they saw."""

from __future__ import annotations

from dataclasses import dataclass

from veloxquant_mlx.config.kv_cache_config import KVCacheConfig


@dataclass(frozen=True)
class RuleTrace:
    """One rule as the evaluator tried it, with the values of the facts it reads."""

    rule_id: str
    matched: bool
    facts: dict

    def to_dict(self) -> dict:
        return {"rule": self.rule_id, "matched": self.matched, "facts": dict(self.facts)}


@dataclass(frozen=True)
class AdjustmentTrace:
    """One adjustment: whether its condition held, and what it set on the chosen method
    (empty when it held but does not name that method)."""

    adjustment_id: str
    matched: bool
    applied: dict
    facts: dict

    def to_dict(self) -> dict:
        return {"adjustment": self.adjustment_id, "matched": self.matched,
                "applied": dict(self.applied), "facts": dict(self.facts)}


@dataclass(frozen=True)
class Decision:
    policy_name: str
    policy_version: int
    policy_sha256: str
    policy_source: str
    rule_id: str
    config: KVCacheConfig
    reason: str
    rules: tuple  # RuleTrace, in order, up to and including the one that matched
    adjustments: tuple  # AdjustmentTrace, every adjustment
    facts: dict

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
