"""Policy v2: layer profiles for bit_width_inlier, separate key/value bits, and the errors for
bad input (file:line:column and the field path)."""

import re

import pytest

from veloxquant_mlx import HardwareInfo, PolicyError, WorkloadSpec, select_kv_cache_config
from veloxquant_mlx.policy import compile_policy_text, decide, facts_of
from veloxquant_mlx.policy.diff import diff_policies
from veloxquant_mlx.policy.layers import (
    MAX_RESOLVED_LAYERS, LayerProfile, compact_layers, profile_from_node,
)
from veloxquant_mlx.policy.lint import lint_policy
from veloxquant_mlx.policy.simulate import simulate_policy
from veloxquant_mlx.policy.sources import default_policy_path, load_policy

V2_PATH = default_policy_path(2)
V2_TEXT = V2_PATH.read_text(encoding="utf-8")
MEDIUM = "        bit_width_inlier: {base: 2, edges: {layers: 2, bits: 4}}\n"


def v2_edit(old: str, new: str) -> str:
    assert old in V2_TEXT, f"test bug: {old!r} not in the v2 policy"
    return V2_TEXT.replace(old, new, 1)


def compile_v2_edit(old: str, new: str):
    return compile_policy_text(v2_edit(old, new), "policies/p2.yaml")


def medium_bits(policy, n_layers: int):
    facts = facts_of(WorkloadSpec(128, 4096, n_layers, 1), HardwareInfo())
    return decide(policy, facts).config


# ---- resolution at the boundaries ----------------------------------------------------------

EDGES2 = profile_from_node({"base": 2, "edges": {"layers": 2, "bits": 4}})


@pytest.mark.parametrize("n_layers, expected", [
    (1, (4,)),  # fewer layers than the two spans: all edge bits (documented overlap rule)
    (2, (4, 4)),
    (3, (4, 4, 4)),
    (4, (4, 4, 4, 4)),  # exactly 2 * edges: every layer is an edge layer
    (5, (4, 4, 2, 4, 4)),  # the first depth with a middle layer
    (6, (4, 4, 2, 2, 4, 4)),
])
def test_edges_resolve_at_small_depths(n_layers, expected):
    assert EDGES2.resolve(n_layers) == expected


def test_edges_resolve_at_large_depths():
    bits = EDGES2.resolve(80)
    assert len(bits) == 80 and bits[:2] == (4, 4) and bits[-2:] == (4, 4) and set(bits[2:-2]) == {2}
    top = EDGES2.resolve(MAX_RESOLVED_LAYERS)
    assert len(top) == MAX_RESOLVED_LAYERS and top.count(4) == 4
    # Past the cap the profile resolves to its base (documented): no list of a million entries.
    assert EDGES2.resolve(MAX_RESOLVED_LAYERS + 1) == 2
    assert EDGES2.resolve(10**12) == 2


def test_first_and_last_spans_differ_and_overlap_takes_first():
    profile = profile_from_node({"base": 2, "first": {"layers": 1, "bits": 8}, "last": {"layers": 3, "bits": 4}})
    assert profile.resolve(6) == (8, 2, 2, 4, 4, 4)
    assert profile.resolve(4) == (8, 4, 4, 4)
    assert profile.resolve(3) == (8, 4, 4)  # overlap: layer 0 is in both spans, first wins
    assert profile.resolve(1) == (8,)
    only_last = profile_from_node({"base": 3, "last": {"layers": 1, "bits": 4}})
    assert only_last.resolve(1) == (4,) and only_last.resolve(3) == (3, 3, 4)


def test_explicit_list_fits_only_its_depth():
    profile = profile_from_node([4, 2, 2, 4])
    assert profile.resolve(4) == (4, 2, 2, 4)
    with pytest.raises(PolicyError, match="4 entries but the workload has n_layers=5"):
        profile.resolve(5)


def test_compact_layers():
    assert compact_layers((4, 4) + (2,) * 28 + (4, 4)) == "[4, 4] + [2]*28 + [4, 4]"
    assert compact_layers((3, 3, 3)) == "[3]*3"
    assert compact_layers((2, 4)) == "[2, 4]"
    values = (8,) + (2,) * 5 + (4, 4, 4)
    assert eval(compact_layers(values)) == list(values)  # noqa: S307 - our own output, a test


# ---- the packaged v2 policy ----------------------------------------------------------------

def test_default_policy_is_still_v1():
    result = select_kv_cache_config(WorkloadSpec(128, 4096, 32, 1), HardwareInfo())
    assert result.reason.startswith("Policy default v1, rule medium-context")
    assert result.config.bit_width_inlier == 2 and result.config.key_bits is None


def test_v2_decisions_per_layer_and_key_value_bits():
    policy = load_policy(V2_PATH)
    config = medium_bits(policy, 32)
    assert config.method == "kivi" and config.key_bits == 4 and config.value_bits is None
    assert config.bit_width_inlier == (4, 4) + (2,) * 28 + (4, 4)
    assert config.bits_for_layer(0, 32) == 4 and config.bits_for_layer(16, 32) == 2
    short = decide(policy, facts_of(WorkloadSpec(64, 100, 30, 1), HardwareInfo())).config
    assert short.method == "turboquant_rvq" and short.key_bits == 4
    assert short.bit_width_inlier == (4, 4) + (3,) * 26 + (4, 4)
    long = decide(policy, facts_of(WorkloadSpec(128, 64_000, 32, 4), HardwareInfo(32 * 2**30, 4 * 2**30)))
    assert long.config.method == "kvquant" and long.rule_id == "long-context"  # the seed example
    # The reason names the version and rule and shows the list compactly.
    decision = decide(policy, facts_of(WorkloadSpec(128, 4096, 32, 1), HardwareInfo()))
    assert "Policy per-layer v2, rule medium-context" in decision.reason
    assert "bit_width_inlier=[4, 4] + [2]*28 + [4, 4]" in decision.reason
    assert "config: method=kivi, bit_width_inlier=[4, 4] + [2]*28 + [4, 4]" in decision.explain()


def test_v2_configs_are_cached_per_depth():
    policy = compile_policy_text(V2_TEXT, "p2.yaml")
    first = medium_bits(policy, 32)
    assert medium_bits(policy, 32) is first  # shared, not rebuilt per decision
    assert medium_bits(policy, 8) is not first and len(medium_bits(policy, 8).bit_width_inlier) == 8


def test_adjustment_may_set_a_profile_and_the_trail_shows_it_resolved():
    text = v2_edit("      kivi: {kivi_group_size: 64}\n",
                   "      kivi: {kivi_group_size: 64, bit_width_inlier: {base: 3, first: {layers: 1, bits: 8}}}\n")
    policy = compile_policy_text(text, "p2.yaml")
    decision = decide(policy, facts_of(WorkloadSpec(256, 4096, 4, 1), HardwareInfo()))
    assert decision.config.bit_width_inlier == (8, 3, 3, 3)
    applied = decision.to_dict()["adjustments"][0]["applied"]
    assert applied == {"kivi_group_size": 64, "bit_width_inlier": [8, 3, 3, 3]}


def test_v2_lint_simulate_diff():
    v1 = load_policy(default_policy_path(1))
    v2 = load_policy(V2_PATH)
    report = lint_policy(v2)
    assert report.findings == ()
    rows = simulate_policy(v2)["rows"]
    assert {row["decision"]["method"] for row in rows if isinstance(row["decision"], dict)} == {
        "gear", "turboquant_rvq", "kivi", "kvquant"}
    diff = diff_policies(v1, v2)
    changed_rules = {change["new"].split(" by ")[-1] for change in diff["changes"]}
    assert changed_rules == {"short-context", "medium-context"}  # gear and kvquant unchanged
    small = [c for c in diff["changes"] if "n_layers < 5" in c["region"]]
    assert small and all("--n-layers 1 " in c["witness"] for c in small)
    assert diff_policies(v2, v2)["changes"] == []


def test_lint_finds_an_explicit_list_that_does_not_fit():
    policy = compile_v2_edit(MEDIUM, "        bit_width_inlier: [4, 2, 2, 4]\n")
    findings = [f for f in lint_policy(policy).findings if f.kind == "layer-list"]
    assert len(findings) == 1 and findings[0].subject == "medium-context"
    assert "4 entries" in findings[0].message and "--n-layers 1 " in findings[0].witness
    with pytest.raises(PolicyError, match=r"rule medium-context: an explicit bit_width_inlier list has 4"):
        medium_bits(policy, 32)
    assert medium_bits(policy, 4).bit_width_inlier == (4, 2, 2, 4)
    # Guarded by n_layers == 4, the list fits wherever the rule decides: no finding.
    guarded = compile_v2_edit(
        "    when: {fact: seq_len, gte: 2048, lt: 16384}\n    select:\n      method: kivi\n      params:\n"
        "        key_bits: 4\n" + MEDIUM,
        "    when: {all: [{fact: seq_len, gte: 2048, lt: 16384}, {fact: n_layers, eq: 4}]}\n    select:\n"
        "      method: kivi\n      params:\n        key_bits: 4\n        bit_width_inlier: [4, 2, 2, 4]\n"
        "    reason: \"four layers\"\n  - id: medium-any-depth\n"
        "    when: {fact: seq_len, gte: 2048, lt: 16384}\n    select:\n      method: kivi\n      params:\n"
        "        key_bits: 4\n" + MEDIUM)
    assert not [f for f in lint_policy(guarded).findings if f.kind == "layer-list"]


def test_v1_still_refuses_profiles():
    from tests.policy.helpers import compile_edit

    with pytest.raises(PolicyError, match=r"x\.yaml:\d+:\d+: rules\[2\]\.select\.params\.bit_width_inlier"):
        compile_edit("params: {bit_width_inlier: 2}", "params: {bit_width_inlier: {base: 2}}")


# ---- bad input: clear errors with file:line:column and the field path ----------------------

def _error(old: str, new: str) -> str:
    with pytest.raises(PolicyError) as info:
        compile_v2_edit(old, new)
    return str(info.value)


LINE = V2_TEXT[:V2_TEXT.index(MEDIUM)].count("\n") + 1  # the medium rule's profile line


@pytest.mark.parametrize("new, where, words", [
    ("{base: 2, edges: {layers: 65, bits: 4}}", ".bit_width_inlier.edges.layers", "from 1 to 64"),
    ("{base: 2, edges: {layers: 0, bits: 4}}", ".bit_width_inlier.edges.layers", "from 1 to 64"),
    ("{base: 2, edges: {layers: '2', bits: 4}}", ".bit_width_inlier.edges.layers", "from 1 to 64"),
    ("{base: '2', edges: {layers: 2, bits: 4}}", ".bit_width_inlier.base", "integer bit width"),
    ("{base: 2, edges: 2}", ".bit_width_inlier.edges", "a span is {layers: N, bits: BITS}"),
    ("{base: 2, edges: {layers: 2}}", ".bit_width_inlier.edges", "'bits' is missing"),
    ("{edges: {layers: 2, bits: 4}}", ".bit_width_inlier", "'base' is missing"),
    ("{base: 2, middle: {layers: 2, bits: 4}}", ".bit_width_inlier.middle", "unknown key 'middle'"),
    ("{base: 2, edges: {layers: 2, bits: 4}, first: {layers: 1, bits: 8}}", ".bit_width_inlier",
     "edges means the same span at both ends"),
    ("{base: 2, edges: {layers: 2, bits: 5}}", ".bit_width_inlier.edges.bits",
     "5 is invalid for kivi.bit_width_inlier: allowed is one of 2, 3, 4, 8"),
    ("{base: 1, edges: {layers: 2, bits: 4}}", ".bit_width_inlier.base", "1 is invalid for kivi"),
    ("[2, 2, 5]", ".bit_width_inlier[2]", "5 is invalid for kivi"),
    ("[]", ".bit_width_inlier", "holds 1 to 1024 integers"),
    ("'four'", ".bit_width_inlier", "a layer profile {base: BITS"),
])
def test_bad_profiles(new, where, words):
    message = _error(MEDIUM, f"        bit_width_inlier: {new}\n")
    assert re.match(rf"policies/p2\.yaml:{LINE}:\d+: rules\[2\]\.select\.params{re.escape(where)}: ", message), message
    assert words in message, message


def test_profile_on_a_field_that_is_not_per_layer():
    message = _error("params: {gear_bits: 2}", "params: {gear_bits: {base: 2}}")
    assert re.match(r"policies/p2\.yaml:\d+:\d+: rules\[0\]\.select\.params\.gear_bits: ", message), message
    assert "only bit_width_inlier may be per layer" in message


def test_key_bits_on_a_method_without_it():
    message = _error("params: {kvquant_bits: 3, kvquant_outlier_fraction: 0.01}",
                     "params: {kvquant_bits: 3, key_bits: 4}")
    line = V2_TEXT[:V2_TEXT.index("params: {kvquant_bits: 3")].count("\n") + 1
    assert message.startswith(f"policies/p2.yaml:{line}:"), message
    assert "rules[3].select.params.key_bits: does not apply to method kvquant" in message
    assert "it belongs to turboquant_rvq, kivi" in message


def test_key_bits_out_of_range_for_the_method():
    message = _error("        key_bits: 4\n        bit_width_inlier: {base: 3",
                     "        key_bits: 8\n        bit_width_inlier: {base: 3")
    assert "rules[1].select.params.key_bits: 8 is invalid for turboquant_rvq: allowed is 1..4" in message


def test_layer_profile_equality_ignores_the_spec_text():
    a = LayerProfile("spans", base=2, first=(2, 4), last=(2, 4), spec={"x": 1})
    b = LayerProfile("spans", base=2, first=(2, 4), last=(2, 4), spec={"y": 2})
    assert a == b and hash(a) == hash(b) and a.resolve(7) == b.resolve(7)
