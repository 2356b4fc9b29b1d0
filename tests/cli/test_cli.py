"""The `veloxquant` CLI: auto-config and policy subcommands, exit codes 0/1/2, --json, and
never a traceback for bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli.run_cli import run
from veloxquant_mlx.cli.main import COMMANDS
from veloxquant_mlx.policy import sources
from veloxquant_mlx.policy.sources import default_policy_path
from tests.policy.helpers import edited

DEFAULT = str(default_policy_path())
SEED = ["--head-dim", "128", "--seq-len", "64000", "--n-layers", "32", "--batch-size", "4",
        "--total-memory-bytes", str(32 * 2**30), "--active-memory-bytes", str(4 * 2**30)]


def _file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_auto_config_seed_example(capsys):
    code, out, _ = run(capsys, "auto-config", *SEED)
    assert code == 0
    assert "method=kvquant" in out and "rule long-context" in out


def test_auto_config_explain_and_json(capsys):
    code, out, _ = run(capsys, "auto-config", *SEED, "--explain")
    assert code == 0 and "rule memory-pressure: no" in out and "rule long-context: MATCH" in out
    code, out, _ = run(capsys, "auto-config", *SEED, "--json", "--explain")
    data = json.loads(out)
    assert code == 0 and data["config"]["method"] == "kvquant"
    assert [r["matched"] for r in data["decision"]["rules"]] == [False, False, False, True]
    code, out, _ = run(capsys, "auto-config", *SEED, "--json")
    assert set(json.loads(out)) == {"config", "reason"}


def test_auto_config_detects_memory_without_flags(capsys, monkeypatch):
    import veloxquant_mlx.cli.common as common
    from veloxquant_mlx import HardwareInfo

    monkeypatch.setattr(common, "detect_hardware_info", lambda: HardwareInfo(1000, 10**9))
    code, out, _ = run(capsys, "auto-config", "--seq-len", "100")
    assert code == 0 and "method=gear" in out


def test_auto_config_unknown_memory(capsys):
    code, out, _ = run(capsys, "auto-config", "--seq-len", "100", "--unknown-memory", "--json", "--explain")
    assert code == 0 and json.loads(out)["decision"]["facts"]["pressure_fraction"] is None


@pytest.mark.parametrize("argv, text", [
    (["auto-config", "--head-dim", "100"], "head_dim=100 is invalid"),
    (["auto-config", "--seq-len", "0"], "seq_len=0 is invalid"),
    (["auto-config", "--seq-len", "abc"], "invalid int value"),
    (["auto-config", "--total-memory-bytes", "-5"], "allowed is an integer >= 0"),
    (["auto-config", "--active-memory-bytes", "5"], "needs --total-memory-bytes"),
    (["auto-config", "--unknown-memory", "--total-memory-bytes", "5"], "contradict"),
    (["auto-config", "--policy", "/nonexistent/p.yaml"], "policy file not found"),
    (["auto-config", "--bogus"], "unrecognized arguments"),
    (["policy"], "required"),
    (["policy", "frobnicate", "x"], "invalid choice"),
    (["nosuchcommand"], "invalid choice"),
    (["policy", "validate", "/nonexistent.yaml"], "not found"),
])
def test_usage_and_input_errors_exit_2(capsys, argv, text):
    code, out, err = run(capsys, *argv)
    assert code == 2 and text in out + err


def test_error_as_json(capsys):
    code, out, _ = run(capsys, "policy", "validate", "/nonexistent.yaml", "--json")
    assert code == 2 and "not found" in json.loads(out)["error"]


def test_validate(capsys, tmp_path):
    code, out, _ = run(capsys, "policy", "validate", DEFAULT)
    assert code == 0 and "valid: policy default v1, 4 rules, 1 adjustments" in out
    code, out, _ = run(capsys, "policy", "validate", DEFAULT, "--json")
    assert json.loads(out)["rules"] == ["memory-pressure", "short-context", "medium-context", "long-context"]
    bad = _file(tmp_path, "bad.yaml", edited("params: {bit_width_inlier: 2}",
                                             "params: {bit_width_inlier: 2, kivi_group_size: 48}"))
    code, _, err = run(capsys, "policy", "validate", bad)
    assert code == 2
    assert f"{bad}:32:54: rules[2].select.params.kivi_group_size: 48 is invalid for kivi: allowed is one of (32, 64, 128)" in err


@pytest.mark.parametrize("text", [
    "!!python/object/apply:os.system ['echo hi']",
    "a: &a [x]\n" + "".join(f"b{i}: *a\n" for i in range(100)),
    "[" * 1000,
    "\x00\x01",
    "policy_version: 9\nname: x\nrules: []\n",
])
def test_hostile_files_exit_2_cleanly(capsys, tmp_path, text):
    path = _file(tmp_path, "h.yaml", text)
    for action in ("validate", "lint", "simulate"):
        code, _, err = run(capsys, "policy", action, path)
        assert code == 2 and err.startswith("veloxquant policy: error: ")


def test_lint_exit_codes(capsys, tmp_path):
    code, out, _ = run(capsys, "policy", "lint", DEFAULT)
    assert code == 0 and "ok:" in out
    gap = _file(tmp_path, "gap.yaml", edited("when: {fact: seq_len, gte: 16384}",
                                             "when: {fact: seq_len, gte: 16384, lt: 100000}"))
    code, out, _ = run(capsys, "policy", "lint", gap)
    assert code == 1 and "gap:" in out and "witness: --head-dim" in out
    code, out, _ = run(capsys, "policy", "lint", gap, "--json")
    findings = json.loads(out)["findings"]
    assert code == 1 and findings[0]["kind"] == "gap"
    # The witness replays through `policy explain` and shows the gap as an error.
    code, _, err = run(capsys, "policy", "explain", gap, *findings[0]["witness"].split())
    assert code == 2 and "no rule matches" in err


def test_explain(capsys):
    code, out, _ = run(capsys, "policy", "explain", DEFAULT, *SEED)
    assert code == 0 and "rule long-context: MATCH" in out
    code, out, _ = run(capsys, "policy", "explain", DEFAULT, *SEED, "--json")
    assert json.loads(out)["rule"] == "long-context"


def test_simulate(capsys):
    code, out, _ = run(capsys, "policy", "simulate", DEFAULT)
    assert code == 0 and "seq_len < 2048" in out and "kvquant (long-context+wide-heads)" in out
    code, out, _ = run(capsys, "policy", "simulate", DEFAULT, "--json")
    assert len(json.loads(out)["rows"]) == 60


def test_diff(capsys, tmp_path):
    code, out, _ = run(capsys, "policy", "diff", DEFAULT, DEFAULT)
    assert code == 0 and "no decision changes" in out
    new = _file(tmp_path, "new.yaml", edited("gte: 0.75", "gte: 0.9"))
    code, out, _ = run(capsys, "policy", "diff", DEFAULT, new)
    assert code == 1 and "0.75 <= pressure_fraction < 0.9" in out
    code, out, _ = run(capsys, "policy", "diff", DEFAULT, new, "--json")
    assert code == 1 and all(c["old"].startswith("gear") for c in json.loads(out)["changes"])


def test_registry_lists_pluggable_commands():
    assert {"auto-config", "policy", "demo", "bench"} <= set(COMMANDS)


def test_console_entry_point_in_a_subprocess(tmp_path):
    """`python -m veloxquant_mlx.cli.main` (what the console script calls) from another cwd."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    env.pop(sources.ENV_VAR, None)
    bad = _file(tmp_path, "bad.yaml", "name: !!python/name:os.system\n")
    proc = subprocess.run([sys.executable, "-m", "veloxquant_mlx.cli.main", "policy", "validate", bad],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "is not allowed" in proc.stderr
