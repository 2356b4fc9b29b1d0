"""`veloxquant policy ...` and `auto-config --policy` on a v2 policy: per-layer lists shown
compactly in text and on one line in JSON, diff between v1 and v2, errors as one clean line."""

import json

from tests.cli.run_cli import run
from veloxquant_mlx.policy.sources import default_policy_path

V1 = str(default_policy_path(1))
V2 = str(default_policy_path(2))
MEDIUM = ["--head-dim", "128", "--seq-len", "4096", "--n-layers", "32", "--batch-size", "1", "--unknown-memory"]


def test_validate_and_lint_v2(capsys):
    code, out, _ = run(capsys, "policy", "validate", V2)
    assert code == 0 and "valid: policy per-layer v2, 4 rules, 1 adjustments" in out
    code, out, _ = run(capsys, "policy", "lint", V2)
    assert code == 0 and out.strip().endswith("every adjustment touches a chosen method")


def test_explain_v2_text_and_json(capsys):
    code, out, _ = run(capsys, "policy", "explain", V2, *MEDIUM)
    assert code == 0
    assert "config: method=kivi, bit_width_inlier=[4, 4] + [2]*28 + [4, 4], key_bits=4" in out
    code, out, _ = run(capsys, "policy", "explain", V2, *MEDIUM, "--json")
    assert code == 0
    assert '"bit_width_inlier": [4, 4, 2, 2, 2,' in out  # one line, not one line per layer
    data = json.loads(out)
    assert data["config"]["bit_width_inlier"] == [4, 4] + [2] * 28 + [4, 4]
    assert data["policy"]["version"] == 2 and data["rule"] == "medium-context"


def test_auto_config_with_v2(capsys):
    code, out, _ = run(capsys, "auto-config", "--policy", V2, *MEDIUM)
    assert code == 0 and "rule medium-context" in out and "key_bits=4" in out
    code, out, _ = run(capsys, "auto-config", *MEDIUM)  # without --policy: still v1
    assert code == 0 and "Policy default v1" in out


def test_simulate_v2_marks_key_value_and_per_layer_bits(capsys):
    code, out, _ = run(capsys, "policy", "simulate", V2)
    assert code == 0
    assert "kivi [K4/V2..4] (medium-context)" in out and "turboquant_rvq [K4/V3..4] (short-context)" in out
    code, out, _ = run(capsys, "policy", "simulate", V2, "--json")
    assert code == 0 and len(json.loads(out)["rows"]) == 60


def test_diff_v1_to_v2(capsys):
    code, out, _ = run(capsys, "policy", "diff", V1, V2)
    assert code == 1
    assert "new: kivi(bit_width_inlier=[4, 4] + [2]*28 + [4, 4], key_bits=4" in out
    assert "n_layers < 5" in out and "--n-layers 1 " in out
    code, out, _ = run(capsys, "policy", "diff", V1, V2, "--json")
    changes = json.loads(out)["changes"]
    assert code == 1 and {c["new"].split(" by ")[-1] for c in changes} == {"short-context", "medium-context"}
    code, out, _ = run(capsys, "policy", "diff", V2, V2)
    assert code == 0 and "no decision changes" in out


def test_bad_v2_profile_is_one_clean_error(capsys, tmp_path):
    text = default_policy_path(2).read_text().replace("edges: {layers: 2, bits: 4}}\n    reason: \"2048",
                                                      "edges: {layers: 99, bits: 4}}\n    reason: \"2048", 1)
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    code, out, err = run(capsys, "policy", "validate", str(path))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "rules[2].select.params.bit_width_inlier.edges.layers: 99 is invalid" in err
    assert f"{path}:" in err
