"""Where a policy comes from: packaged default, VELOXQUANT_POLICY, explicit argument; the
compiled cache and its reload; never a silent fallback."""

import os

import pytest

from veloxquant_mlx import PolicyError, WorkloadSpec, HardwareInfo, select_kv_cache_config
from veloxquant_mlx.policy import sources
from veloxquant_mlx.policy.sources import ENV_VAR, default_policy_path, load_policy, resolve_policy
from tests.policy.helpers import DEFAULT_TEXT, edited

SHORT = WorkloadSpec(seq_len=100)
NO_MEMORY = HardwareInfo()


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    sources.clear_cache()
    yield
    sources.clear_cache()


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_packaged_default():
    policy = resolve_policy()
    assert (policy.name, policy.version) == ("default", 1)
    assert os.fspath(default_policy_path()).endswith("policies/kv_cache_policy.v1.yaml")


def test_env_path(monkeypatch, tmp_path):
    path = _write(tmp_path / "p.yaml", edited("name: default", "name: from-env"))
    monkeypatch.setenv(ENV_VAR, str(path))
    result = select_kv_cache_config(SHORT, NO_MEMORY)
    assert result.decision.policy_name == "from-env" and "Policy from-env v1" in result.reason


def test_explicit_argument_wins_over_env(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_VAR, str(_write(tmp_path / "env.yaml", edited("name: default", "name: env"))))
    explicit = _write(tmp_path / "arg.yaml", edited("name: default", "name: arg"))
    assert select_kv_cache_config(SHORT, NO_MEMORY, policy=explicit).decision.policy_name == "arg"
    assert select_kv_cache_config(SHORT, NO_MEMORY, policy=str(explicit)).decision.policy_name == "arg"
    compiled = load_policy(explicit)
    assert select_kv_cache_config(SHORT, NO_MEMORY, policy=compiled).decision.policy_name == "arg"


@pytest.mark.parametrize("how", ["env", "argument"])
def test_invalid_policy_never_falls_back(monkeypatch, tmp_path, how):
    bad = _write(tmp_path / "bad.yaml", edited("method: kivi", "method: kiwi"))
    missing = tmp_path / "missing.yaml"
    for path, pattern in ((bad, r"bad\.yaml:\d+:\d+: .*'kiwi' is unknown"), (missing, "not found")):
        kwargs = {}
        if how == "env":
            monkeypatch.setenv(ENV_VAR, str(path))
        else:
            kwargs["policy"] = path
        with pytest.raises(PolicyError, match=pattern):
            select_kv_cache_config(SHORT, NO_MEMORY, **kwargs)


def test_wrong_policy_argument_type():
    with pytest.raises(PolicyError, match="policy=42 is invalid"):
        select_kv_cache_config(SHORT, NO_MEMORY, policy=42)
    with pytest.raises(PolicyError, match="directory"):
        load_policy(os.path.dirname(default_policy_path()))


def test_cache_reuses_and_reloads_on_change(tmp_path):
    path = _write(tmp_path / "p.yaml", DEFAULT_TEXT)
    first = load_policy(path)
    assert load_policy(path) is first  # unchanged file: the compiled policy is reused
    _write(path, edited("params: {bit_width_inlier: 4}", "params: {bit_width_inlier: 3}"))
    os.utime(path, ns=(1, 1))  # a different mtime even on coarse clocks
    second = load_policy(path)
    assert second is not first and second.sha256 != first.sha256
    assert select_kv_cache_config(SHORT, NO_MEMORY, policy=path).config.bit_width_inlier == 3
    os.utime(path, ns=(2, 2))  # touched, same content: re-read but not recompiled
    assert load_policy(path) is second


def test_broken_edit_of_cached_file_raises(tmp_path):
    path = _write(tmp_path / "p.yaml", DEFAULT_TEXT)
    load_policy(path)
    _write(path, DEFAULT_TEXT + "\n  oops: [\n")
    os.utime(path, ns=(5, 5))
    with pytest.raises(PolicyError, match="malformed YAML"):
        load_policy(path)
