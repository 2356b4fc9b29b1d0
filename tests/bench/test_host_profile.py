"""bench.host_profile: a prefill's and a decode's host time by function, for fp16 and our caches."""

import json

import pytest

from veloxquant_mlx.bench import host_profile

TINY = ["--layers", "2", "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--head-dim", "32",
        "--intermediate", "256", "--vocab", "256", "--prefill-step-size", "64", "--context", "200",
        "--dtype", "float32", "--top", "12"]


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_a_tiny_run_profiles_each_spec(tmp_path, capsys, mode):
    out = tmp_path / "hp.json"
    assert host_profile.main([mode, *TINY, "--methods", "fp16,kivi", "--steps", "8", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["settings"]["mode"] == mode and list(data["specs"]) == ["fp16", "kivi"]
    for name, entry in data["specs"].items():
        rows = entry["top_by_own_time"]
        assert 0 < len(rows) <= 12
        assert all(r["calls"] >= 1 and r["cumulative_s"] >= r["own_s"] >= 0 for r in rows)
        assert [r["own_s"] for r in rows] == sorted((r["own_s"] for r in rows), reverse=True)
        timings = ("fill_s", "host_s") if mode == "prefill" else ("step_ms", "host_median_ms")
        assert all(entry[k] > 0 for k in timings)
    # The compressed cache's own code is in its profile (the model call reaches it), not fp16's.
    ours = [r["function"] for r in data["specs"]["kivi"]["top_by_own_time"]]
    theirs = [r["function"] for r in data["specs"]["fp16"]["top_by_own_time"]]
    assert any("veloxquant_mlx" in f for f in ours) and not any("veloxquant_mlx/cache" in f for f in theirs)
    assert "##### kivi" in capsys.readouterr().out


def test_first_steps_profiles_the_steps_right_after_the_prefill_and_keeps_each(tmp_path, capsys):
    out = tmp_path / "hp.json"
    assert host_profile.main(["decode", *TINY, "--methods", "kivi", "--steps", "6", "--first-steps",
                              "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    entry = data["specs"]["kivi"]
    assert data["settings"]["first_steps"] is True
    assert len(entry["profiled_host_ms"]) == 6 and all(ms > 0 for ms in entry["profiled_host_ms"])
    assert "step_ms" not in entry  # no timed burst before the profiled steps
    assert "host ms per step, in order:" in capsys.readouterr().out


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--context", "1"], ["--top", "0"]])
def test_refuses_bad_counts(tmp_path, capsys, bad):
    with pytest.raises(SystemExit):
        host_profile.parse_args(["decode", "--out", str(tmp_path / "x.json"), *bad])
    assert "allowed is" in capsys.readouterr().err


def test_first_steps_is_refused_in_prefill_mode(tmp_path, capsys):
    with pytest.raises(SystemExit):
        host_profile.parse_args(["prefill", "--first-steps", "--out", str(tmp_path / "x.json")])
    assert "--first-steps is a decode-mode option" in capsys.readouterr().err
