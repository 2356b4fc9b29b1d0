"""The `python -m veloxquant_mlx.bench.<name>` measurement modules: each parses --help, runs a
tiny configuration end to end (seconds), and writes a self-describing JSON."""

import importlib
import json
import subprocess
import sys

import pytest

from veloxquant_mlx.bench import timing

MODULES = ["attention", "encode", "synthetic", "lowrank", "quality_split", "rvq_attribution", "ops",
           "kernel_probe", "prefill_peak"]


@pytest.mark.parametrize("name", MODULES)
def test_help_parses(name, capsys):
    module = importlib.import_module(f"veloxquant_mlx.bench.{name}")
    with pytest.raises(SystemExit) as info:
        module.main(["--help"])
    assert info.value.code == 0
    assert f"python -m veloxquant_mlx.bench.{name}" in capsys.readouterr().out


def test_help_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "veloxquant_mlx.bench.encode", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--context" in done.stdout


def _run(name, argv, tmp_path):
    out = tmp_path / f"{name}.json"
    module = importlib.import_module(f"veloxquant_mlx.bench.{name}")
    assert module.main([*argv, "--no-openblas", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["command"] and result["machine"]["cpu_count"] and result["date"]
    return result["results"]


def test_attention_tiny(tmp_path):
    rows = _run("attention", ["--context", "96", "--rounds", "2", "--methods",
                              "fp16,mlx-q4,kivi:kivi_residual_length=0"], tmp_path)
    assert list(rows) == ["fp16", "mlx-q4", "kivi:kivi_residual_length=0"]
    for row in rows.values():
        assert "error" not in row and row["microseconds"]["n"] == 2 and row["microseconds"]["min"] > 0
        assert row["cpu_microseconds"]["n"] == 2 and row["peak_added_bytes"] >= 0
    assert rows["kivi:kivi_residual_length=0"]["cache_nbytes"] < rows["fp16"]["cache_nbytes"]


def test_attention_times_minicaches_upper_layer_and_says_which_kind(tmp_path):
    rows = _run("attention", ["--context", "200", "--rounds", "2", "--methods",
                              "minicache,minicache:minicache_start_fraction=0"], tmp_path)
    assert rows["minicache"]["layer_timed"] == "plain (unpaired)"  # layer 1 of 2 at start 0.5
    assert rows["minicache:minicache_start_fraction=0"]["layer_timed"] == "paired (upper)"
    assert all("error" not in row and row["microseconds"]["n"] == 2 for row in rows.values())


def test_attention_kernels_both_adds_portable_rows(tmp_path):
    rows = _run("attention", ["--context", "96", "--rounds", "1", "--kernels", "both", "--methods",
                              "fp16,kivi:kivi_residual_length=0"], tmp_path)
    # On the CPU both rows run the portable path; on CUDA the first runs the kernels.
    assert list(rows) == ["fp16", "kivi:kivi_residual_length=0", "kivi:kivi_residual_length=0 (portable)"]
    assert all(row["microseconds"]["n"] == 1 for row in rows.values())


def test_encode_tiny_checks_the_accounting(tmp_path):
    rows = _run("encode", ["--context", "128", "--layers", "2", "--chunk", "64", "--rounds", "1",
                           "--methods", "fp16,kivi:kivi_residual_length=0,gear-block64"], tmp_path)
    # mlx-lm's KVCache grows 256 tokens at a time: 128 tokens hold twice their bytes.
    assert rows["fp16"]["ratio_vs_fp16"] == pytest.approx(2.0)
    kivi = rows["kivi:kivi_residual_length=0"]
    assert kivi["compressed_tokens"] == 128 and kivi["window_tokens"] == 0
    assert kivi["store_over_accounting"] == pytest.approx(1.0, abs=0.02)
    assert kivi["ratio_vs_fp16"] < 0.5 and kivi["encode_s"]["n"] == 1
    assert rows["gear-block64"]["kind"] == "ablation" and rows["gear-block64"]["compressed_tokens"] == 128


def test_synthetic_tiny(tmp_path):
    rows = _run("synthetic", ["--data", "fixed-channels", "--tokens", "128", "--seeds", "2",
                              "--queries", "2", "--methods", "fp16,mlx-q2:group_size=32,kvquant"], tmp_path)
    assert rows["fp16"]["mean"]["rel_error"] < 0.01  # fp16 storage of fp16 data: rounding only
    assert len(rows["kvquant"]["per_seed"]) == 2
    # KVQuant's per-channel keys with outliers beat per-token 2-bit on outlier channels.
    assert rows["kvquant"]["mean"]["rel_error"] < rows["mlx-q2:group_size=32"]["mean"]["rel_error"]
    assert rows["kvquant"]["mean"]["accounting_bits_per_element"] > 0


def test_lowrank_tiny(tmp_path):
    rows = _run("lowrank", ["--heads", "1", "--blocks", "2", "--block-tokens", "32",
                            "--head-dim", "16", "--rounds", "1"], tmp_path)
    # The exact truncated SVD is the best rank-r approximation: power iteration cannot beat it.
    assert rows["svd"]["relative_error"] <= rows["power_iteration"]["relative_error"] + 1e-4
    assert rows["power_iteration"]["relative_error"] < 1.0


def test_quality_split_tiny_random_model(tmp_path):
    rows = _run("quality_split", ["--random-model", "tiny", "--tokens", "48", "--prefill", "8",
                                  "--from-row", "32", "--methods", "fp16,gear-block64"], tmp_path)
    assert rows["fp16"]["all_decoded"]["kl_mean"] == pytest.approx(0.0, abs=1e-6)
    gear = rows["gear-block64"]
    assert gear["all_decoded"]["rows"] == 40 and gear["from_row"]["rows"] == 15
    assert gear["nbytes_after_run"] > 0 and "error" not in gear


def test_ops_tiny_against_head(tmp_path):
    import mlx_lm.models.cache as mlx_lm_cache

    from veloxquant_mlx.cache.kvquant import KVQuantCache

    # HEAD's cache code on the same store: same outputs; a ratio of medians for each op.
    rows = _run("ops", ["--context", "320", "--rounds", "2", "--baseline", "HEAD", "--reference",
                        "--methods", "kvquant,gear"], tmp_path)
    for name in ("kvquant", "gear"):
        assert "error" not in rows[name] and rows[name]["capacity"] > 0
        for op in ("scores", "values"):
            entry = rows[name][op]
            assert entry["current"]["n"] == entry["baseline"]["n"] == 2
            assert entry["max_rel_diff"] == pytest.approx(0.0, abs=1e-6)
            assert entry["baseline_over_current"] > 0
    assert rows["mlx-q4 scores"]["microseconds"]["min"] > 0
    # Importing the baseline package left mlx-lm's loader bound to the current classes.
    assert mlx_lm_cache.KVQuantCache is KVQuantCache


def test_ops_without_baseline(tmp_path):
    rows = _run("ops", ["--context", "96", "--rounds", "1", "--methods", "kivi:kivi_residual_length=0"],
                tmp_path)
    row = rows["kivi:kivi_residual_length=0"]
    assert row["scores"]["current"]["n"] == 1 and "baseline" not in row["values"]
    assert row["cache_nbytes"] > 0
    # Too short a context to compress anything is that spec's error, not a crash.
    rows = _run("ops", ["--context", "8", "--rounds", "1", "--methods", "gear"], tmp_path)
    assert "leaves nothing compressed" in rows["gear"]["error"]


@pytest.mark.parametrize("name,argv", [
    ("attention", ["--methods", "mlx-q7"]),
    ("ops", ["--methods", "fp16"]),
    ("synthetic", ["--methods", "gear-magnitude:gear_nope=1"]),
])
def test_bad_spec_exits_2(name, argv, capsys, tmp_path):
    module = importlib.import_module(f"veloxquant_mlx.bench.{name}")
    assert module.main([*argv, "--no-openblas", "--out", str(tmp_path / "x.json")]) == 2
    assert argv[1].split(":")[0] in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("name,argv", [
    ("lowrank", ["--rank", "99"]),
    ("synthetic", ["--data", "fixed-channels", "--head-dim", "32"]),
    ("quality_split", ["--tokens", "64", "--prefill", "64"]),
    ("quality_split", ["--from-row", "600"]),
    ("encode", ["--context", "0"]),
    ("ops", ["--q-heads", "4", "--kv-heads", "3"]),
    ("ops", ["--baseline", "no-such-ref-xyz"]),
    ("prefill_peak", ["--parts", "layer,everything"]),
    ("prefill_peak", ["--model-cases", "fp16,middle"]),
])
def test_bad_arguments_are_usage_errors(name, argv):
    module = importlib.import_module(f"veloxquant_mlx.bench.{name}")
    with pytest.raises(SystemExit) as info:
        module.parse_args(argv)
    assert info.value.code == 2


def test_summarize_reports_spread():
    s = timing.summarize([3.0, 1.0, 2.0, 4.0], unit=1e-3)
    assert (s["min"], s["median"], s["max"], s["n"]) == (1000.0, 2500.0, 4000.0, 4)
    assert s["p25"] == pytest.approx(1750.0) and s["p75"] == pytest.approx(3250.0)
    assert timing.summarize([])["median"] is None
    with pytest.raises(ValueError, match="rounds"):
        timing.time_calls({"a": lambda: None}, rounds=0)
