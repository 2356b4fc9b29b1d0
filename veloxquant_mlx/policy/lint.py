"""Lint: does the policy decide every valid workload, can every rule fire, does every
adjustment touch something? Exact, by band analysis (bands.py), not by sampling.

Findings, each with a concrete workload (as CLI flags) that shows it:
  gap               no rule matches anywhere in a region of the fact space;
  unreachable-rule  a rule never decides: earlier rules take every workload where its condition
                    holds (witness: one such workload and the rule that took it), or its
                    condition holds for no valid workload;
  inert-adjustment  an adjustment never changes a decision: where its condition holds, none of
                    the methods it names is chosen;
  inert-adjustment-method  one method an adjustment names is never chosen where it holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from veloxquant_mlx.policy.bands import (
    cells, describe_region, dims_of, merge_regions, witness, workload_flags,
)
from veloxquant_mlx.policy.compiler import CompiledPolicy
from veloxquant_mlx.policy.evaluator import choose


@dataclass(frozen=True)
class Finding:
    kind: str
    subject: str  # rule or adjustment id, or the region for a gap
    message: str
    witness: str | None  # CLI flags of a workload that shows it

    def to_dict(self) -> dict:
        return {"kind": self.kind, "subject": self.subject, "message": self.message,
                "witness": self.witness}


@dataclass(frozen=True)
class LintReport:
    policy: str
    cells: int
    infeasible_cells: int
    findings: tuple

    def to_dict(self) -> dict:
        return {"policy": self.policy, "cells": self.cells, "infeasible_cells": self.infeasible_cells,
                "findings": [f.to_dict() for f in self.findings]}


def lint_policy(policy: CompiledPolicy) -> LintReport:
    dims = dims_of(policy.thresholds())
    outcomes = {}  # index -> (rule or None, applied, witness)
    infeasible = 0
    total = 0
    for index, cell in cells(dims):
        total += 1
        found = witness(cell)
        if found is None:
            infeasible += 1
            continue
        workload, hardware, facts = found
        chosen = choose(policy, facts)
        outcomes[index] = (chosen, found)
    findings = []

    # Gaps, merged into regions.
    gaps = {index: "gap" for index, (chosen, _) in outcomes.items() if chosen is None}
    for _, ranges in merge_regions(gaps):
        first = tuple(lo for lo, _ in ranges)
        workload, hardware, _ = outcomes[first][1] if first in outcomes else next(
            outcomes[i][1] for i in gaps if all(lo <= x <= hi for x, (lo, hi) in zip(i, ranges)))
        region = describe_region(dims, ranges)
        findings.append(Finding("gap", region, f"no rule decides workloads where {region}",
                                workload_flags(workload, hardware)))

    # Rules that never decide.
    for rule in policy.rules:
        if any(chosen and chosen[0] is rule for chosen, _ in outcomes.values()):
            continue
        shadow = next(((chosen, found) for chosen, found in outcomes.values()
                       if rule.test(found[2])), None)
        if shadow is None:
            findings.append(Finding("unreachable-rule", rule.id,
                                    f"rule {rule.id} can never fire: its condition "
                                    f"({rule.condition.describe()}) holds for no valid workload", None))
        else:
            chosen, (workload, hardware, _) = shadow
            findings.append(Finding("unreachable-rule", rule.id,
                                    f"rule {rule.id} can never fire: earlier rules decide every "
                                    f"workload where {rule.condition.describe()}; e.g. rule "
                                    f"{chosen[0].id} takes this one", workload_flags(workload, hardware)))

    # Adjustments that change nothing.
    for adj in policy.adjustments:
        held = [(chosen, found) for chosen, found in outcomes.values()
                if chosen is not None and adj.test(found[2])]
        reached = {chosen[0].method for chosen, _ in held}
        touched = reached & set(adj.sets)
        if not held:
            findings.append(Finding("inert-adjustment", adj.id,
                                    f"adjustment {adj.id} never applies: its condition "
                                    f"({adj.condition.describe()}) holds for no decided workload", None))
            continue
        if not touched:
            chosen, (workload, hardware, _) = held[0]
            findings.append(Finding("inert-adjustment", adj.id,
                                    f"adjustment {adj.id} touches nothing: where it holds only "
                                    f"{', '.join(sorted(reached))} are chosen, and it names "
                                    f"{', '.join(adj.sets)}", workload_flags(workload, hardware)))
            continue
        for method in adj.sets:
            if method not in reached:
                findings.append(Finding("inert-adjustment-method", adj.id,
                                        f"adjustment {adj.id} names {method}, which no rule chooses "
                                        f"where {adj.condition.describe()}", None))
    return LintReport(f"{policy.name} v{policy.version}", total, infeasible, tuple(findings))


def format_report(report: LintReport) -> str:
    lines = [f"lint {report.policy}: {report.cells} cells of the fact space, "
             f"{report.infeasible_cells} without any valid workload"]
    if not report.findings:
        lines.append("ok: every valid workload is decided, every rule can fire, every adjustment "
                     "touches a chosen method")
    for finding in report.findings:
        lines.append(f"{finding.kind}: {finding.message}")
        if finding.witness:
            lines.append(f"    witness: {finding.witness}")
    return "\n".join(lines)
