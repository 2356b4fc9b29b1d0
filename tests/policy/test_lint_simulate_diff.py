"""Lint, simulate and diff over the fact space, checked against policies with known defects."""

import pytest

from veloxquant_mlx import PolicyError, HardwareInfo, WorkloadSpec
from veloxquant_mlx.policy import decide, facts_of
from veloxquant_mlx.policy.bands import bands_of, cells, dims_of, witness
from veloxquant_mlx.policy.diff import diff_policies, format_diff
from veloxquant_mlx.policy.lint import format_report, lint_policy
from veloxquant_mlx.policy.simulate import format_table, simulate_policy
from veloxquant_mlx.policy.sources import default_policy_path, load_policy
from tests.policy.helpers import compile_edit, edited
from veloxquant_mlx.policy import compile_policy_text

DEFAULT = load_policy(default_policy_path())


def _replay(flags: str):
    """The workload + hardware a witness's CLI flags describe."""
    parts = flags.split()
    values = {parts[i].lstrip("-").replace("-", "_"): parts[i + 1] for i in range(len(parts))
              if parts[i].startswith("--") and i + 1 < len(parts) and not parts[i + 1].startswith("--")}
    workload = WorkloadSpec(*(int(values[k]) for k in ("head_dim", "seq_len", "n_layers", "batch_size")))
    total = int(values["total_memory_bytes"]) if "total_memory_bytes" in values else None
    return facts_of(workload, HardwareInfo(total, int(values.get("active_memory_bytes", 0))))


def test_default_is_clean():
    report = lint_policy(DEFAULT)
    assert report.findings == () and report.infeasible_cells == 0
    assert report.cells == 60  # head_dim 3 x seq_len 5 x pressure 4 bands
    assert "ok:" in format_report(report)


def test_gap_found_with_a_witness():
    policy = compile_edit("when: {fact: seq_len, gte: 16384}", "when: {fact: seq_len, gte: 16384, lt: 100000}")
    gaps = [f for f in lint_policy(policy).findings if f.kind == "gap"]
    assert len(gaps) == 1
    assert "seq_len >= 100000" in gaps[0].message
    facts = _replay(gaps[0].witness)
    with pytest.raises(PolicyError, match="no rule matches"):
        decide(policy, facts)


def test_gap_between_bands_and_null_pressure():
    policy = compile_edit("when: {fact: seq_len, gte: 2048, lt: 16384}", "when: {fact: seq_len, gte: 4096, lt: 16384}")
    gaps = [f for f in lint_policy(policy).findings if f.kind == "gap"]
    assert len(gaps) == 1 and "2048 <= seq_len < 4096" in gaps[0].message
    assert "pressure_fraction is null" in gaps[0].message
    with pytest.raises(PolicyError):
        decide(policy, _replay(gaps[0].witness))


def test_shadowed_rule_with_witness():
    text = edited("  - id: short-context\n", "  - id: dead\n    when: {fact: pressure_fraction, gt: 0.9}\n"
                  "    select: {method: xquant}\n    reason: never\n  - id: short-context\n")
    policy = compile_policy_text(text, "x.yaml")
    (finding,) = [f for f in lint_policy(policy).findings if f.kind == "unreachable-rule"]
    assert finding.subject == "dead" and "memory-pressure" in finding.message
    facts = _replay(finding.witness)
    assert facts["pressure_fraction"] > 0.9 and decide(policy, facts).rule_id == "memory-pressure"


def test_rule_that_can_never_hold():
    text = edited("  - id: short-context\n", "  - id: impossible\n    when: {fact: head_dim, eq: 3}\n"
                  "    select: {method: xquant}\n    reason: never\n  - id: short-context\n")
    (finding,) = lint_policy(compile_policy_text(text, "x.yaml")).findings
    assert finding.kind == "unreachable-rule" and "holds for no valid workload" in finding.message


def test_adjustment_touching_nothing():
    policy = compile_edit(
        "      kivi: {kivi_group_size: 64}\n      kvquant: {kvquant_group_size: 64}\n      gear: {gear_group_size: 64}\n",
        "      xquant: {xquant_group_size: 64}\n")
    (finding,) = lint_policy(policy).findings
    assert finding.kind == "inert-adjustment" and "xquant" in finding.message and finding.witness


def test_adjustment_naming_an_unreached_method():
    policy = compile_edit("      gear: {gear_group_size: 64}\n",
                          "      gear: {gear_group_size: 64}\n      minicache: {minicache_threshold: 0.5}\n")
    (finding,) = lint_policy(policy).findings
    assert finding.kind == "inert-adjustment-method" and "minicache" in finding.message


def test_bands_are_exact_at_boundaries():
    bands = bands_of("seq_len", {2048, 16384})
    assert [(b.lo, b.hi) for b in bands] == [(1, 2047), (2048, 2048), (2049, 16383), (16384, 16384), (16385, None)]
    heads = bands_of("head_dim", {256, 100})
    assert [(b.lo, b.hi) for b in heads] == [(1, 99), (100, 100), (101, 255), (256, 256), (257, None)][:1] + \
        [(101, 255), (256, 256), (257, None)]  # {100} holds no power of two: dropped
    pressure = bands_of("pressure_fraction", {0.75})
    assert pressure[0].null and pressure[2].contains(0.75) and not pressure[1].contains(0.75)


def test_every_default_cell_has_a_matching_witness():
    dims = dims_of(DEFAULT.thresholds())
    for _, cell in cells(dims):
        found = witness(cell)
        assert found is not None
        assert all(band.contains(found[2][name]) for name, band in cell.items())


def test_derived_fact_bands_get_witnesses():
    text = edited("when: {fact: seq_len, lt: 2048}", "when: {fact: fp16_kv_bytes, lt: 1000000, gte: 999996}")
    policy = compile_policy_text(text, "x.yaml")
    dims = dims_of(policy.thresholds())
    solved = [witness(cell) for _, cell in cells(dims)]
    hits = [w for w in solved if w and 999996 <= w[2]["fp16_kv_bytes"] < 1000000]
    assert hits, "no witness inside the narrow fp16 band"


def test_simulate_table():
    result = simulate_policy(DEFAULT)
    assert len(result["rows"]) == 5 * 3 * 4
    table = format_table(result)
    assert "turboquant_rvq (short-context)" in table and "gear (memory-pressure+wide-heads)" in table
    row = next(r for r in result["rows"] if r["seq_len"] == "seq_len == 2048" and r["head_dim"] == "head_dim == 256"
               and r["pressure_fraction"] == "pressure_fraction is null")
    assert row["decision"]["method"] == "kivi" and row["decision"]["kivi_group_size"] == 64


def test_diff_identical_is_empty():
    assert diff_policies(DEFAULT, DEFAULT)["changes"] == []
    assert "no decision changes" in format_diff(diff_policies(DEFAULT, DEFAULT))


def test_diff_reports_changed_bands():
    new = compile_edit("when: {fact: seq_len, lt: 2048}", "when: {fact: seq_len, lt: 4096}")
    result = diff_policies(DEFAULT, new)
    regions = [c["region"] for c in result["changes"]]
    assert regions and all("2048 <= seq_len < 4096" in r for r in regions)
    for change in result["changes"]:
        assert change["old"].startswith("kivi") and change["new"].startswith("turboquant_rvq")
        facts = _replay(change["witness"])
        assert decide(DEFAULT, facts).config.method == "kivi"
        assert decide(new, facts).config.method == "turboquant_rvq"


def test_too_many_cells_is_refused():
    rules = "".join(f"  - id: r{i}\n    when: {{fact: seq_len, lt: {10 * i + 10}}}\n    select: {{method: kivi}}\n"
                    f"    reason: r\n" for i in range(120))
    rules += "".join(f"  - id: h{i}\n    when: {{fact: n_layers, lt: {10 * i + 10}}}\n    select: {{method: kivi}}\n"
                     f"    reason: r\n" for i in range(120))
    with pytest.raises(PolicyError, match="cells"):
        lint_policy(compile_policy_text(f"policy_version: 1\nname: big\nrules:\n{rules}"
                                        + "".join(f"  - id: b{i}\n    when: {{fact: batch_size, lt: {10 * i + 10}}}\n"
                                                  "    select: {method: kivi}\n    reason: r\n" for i in range(10)),
                                        "x.yaml"))
