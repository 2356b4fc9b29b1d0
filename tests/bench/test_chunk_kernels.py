"""chunk_kernels: the ncu workload runs (the profiler calls are no-ops off CUDA) and the CSV summary."""

from __future__ import annotations

import json

import pytest

from veloxquant_mlx.bench import chunk_kernels

_CSV = """==PROF== Connected to process 1
"ID","Process ID","Kernel Name","Metric Name","Metric Unit","Metric Value"
"0","1","void mlx::copy_s<__nv_bfloat16, unsigned int, 8>(const T1 *, T2 *)","gpu__time_duration.sum","ns","4,832"
"1","1","cudnn_generated_sdpa_fprop","gpu__time_duration.sum","ns","1,601,472"
"2","1","void mlx::copy_s<float, unsigned int, 4>(const T1 *, T2 *)","gpu__time_duration.sum","ns","3,168"
==PROF== Disconnected from process 1
"""


def test_summary_sums_each_kernel_family_largest_first(tmp_path):
    path = tmp_path / "fp16.csv"
    path.write_text(_CSV)
    out = tmp_path / "out.json"
    assert chunk_kernels.main(["summarize", "--csv", f"fp16={path}", "--out", str(out)]) == 0
    got = json.loads(out.read_text())["methods"]["fp16"]
    assert got["kernels"] == 3
    assert got["total_us"] == pytest.approx((4832 + 1601472 + 3168) / 1e3)
    assert got["by_kernel"] == [
        {"kernel": "cudnn_generated_sdpa_fprop", "launches": 1, "us": pytest.approx(1601.472),
         "median_us": pytest.approx(1601.472), "max_us": pytest.approx(1601.472)},
        {"kernel": "mlx::copy_s", "launches": 2, "us": pytest.approx(8.0),
         "median_us": pytest.approx(4.0), "max_us": pytest.approx(4.832)},
    ]


def test_a_familys_median_launch_sets_a_first_step_outlier_apart():
    # Four decode steps of one attention kernel, the first also encoding the prefill's window.
    got = chunk_kernels.summarize([("attend", 670e3), ("copy", 3e3), ("attend", 82e3),
                                   ("attend", 81e3), ("attend", 83e3)], top=5)
    attend = got["by_kernel"][0]
    assert attend["kernel"] == "attend" and attend["launches"] == 4
    assert attend["us"] == pytest.approx(916) and attend["median_us"] == pytest.approx(82.5)
    assert attend["max_us"] == pytest.approx(670)


def test_a_csv_of_another_metric_is_refused_with_its_row(tmp_path):
    path = tmp_path / "x.csv"
    path.write_text(_CSV.replace('"2","1","void mlx::copy_s<float, unsigned int, 4>(const T1 *, T2 *)","gpu__time_duration.sum"',
                                 '"2","1","k","sm__cycles_elapsed.avg"'))
    with pytest.raises(ValueError, match=r"x.csv: CSV row 4: metric 'sm__cycles_elapsed.avg'"):
        chunk_kernels.read_csv(str(path))


def test_a_file_without_csv_rows_is_refused(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("==PROF== nothing\n")
    with pytest.raises(ValueError, match="empty.csv: no CSV rows"):
        chunk_kernels.read_csv(str(path))


def test_a_context_shorter_than_two_chunks_is_refused(capsys):
    with pytest.raises(SystemExit):
        chunk_kernels.parse_args(["profile", "--method", "kivi", "--context", "256", "--chunk", "256"])
    assert "--context 256 / --chunk 256" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["fp16", "kvquant"])
def test_profile_runs_the_last_chunk_and_times_it(method):
    got = chunk_kernels.profile(method, context=192, chunk=64, timed=2)
    assert got["method"] == method and got["chunk"] == 64 and got["cached_before_profiled"] == 128
    assert len(got["timed_chunk_s"]) == 2 and all(s > 0 for s in got["timed_chunk_s"])


@pytest.mark.parametrize("method", ["fp16", "kivi"])
def test_profile_runs_decode_steps_after_the_whole_context(method):
    # The whole context prefilled first (a fill made of decode steps once profiled a nearly
    # empty cache: session 19's first H200 run of this mode, not kept).
    got = chunk_kernels.profile(method, context=192, chunk=64, timed=2, decode_steps=3)
    assert got["decode_steps"] == 3 and got["cached_before_profiled"] == 192 and len(got["timed_chunk_s"]) == 2


def test_a_negative_decode_step_count_is_refused(capsys):
    with pytest.raises(SystemExit):
        chunk_kernels.parse_args(["profile", "--method", "kivi", "--decode-steps", "-1"])
    assert "--decode-steps -1: allowed is 0 (the last chunk) or more steps" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["fp16", "kivi"])
def test_a_decode_step_appends_one_token_and_attends_its_row(method, monkeypatch):
    import mlx.core as mx

    from veloxquant_mlx.bench.kernel_probe import prefill_inputs, prefill_step
    from veloxquant_mlx.bench.layer_specs import parse_layer_spec

    k, v, q = prefill_inputs(130)
    cache = parse_layer_spec(method).make()
    prefill_step(cache, k, v, q, slice(0, 128))
    seen = []
    real = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (seen.append(a[0].shape), real(*a))[1])
    chunk_kernels.decode_step(cache, k, v, q, 128)
    chunk_kernels.decode_step(cache, k, v, q, 129)
    assert cache.offset == 130 and seen == [(1, 32, 1, 128)] * 2


def test_steps_times_each_decode_step_of_fresh_caches(tmp_path, capsys):
    out = tmp_path / "steps.json"
    assert chunk_kernels.main(["steps", "--methods", "fp16,kivi", "--context", "128", "--chunk", "64",
                               "--steps", "3", "--repeats", "2", "--out", str(out)]) == 0
    got = json.loads(out.read_text())["methods"]
    assert set(got) == {"fp16", "kivi"}
    for method in got:
        runs = got[method]["step_us"]
        assert len(runs) == 2 and all(len(r) == 3 and all(us > 0 for us in r) for r in runs)
    assert "kivi 1 step us: " in capsys.readouterr().out


def test_steps_refuses_zero_steps(capsys):
    with pytest.raises(SystemExit):
        chunk_kernels.parse_args(["steps", "--methods", "kivi", "--steps", "0"])
    assert "--steps 0 / --repeats 2: allowed is at least 1 of each" in capsys.readouterr().err


def test_steps_refuses_an_unknown_method_before_timing_any(monkeypatch, capsys):
    timed = []
    monkeypatch.setattr(chunk_kernels, "step_times", lambda *a, **k: timed.append(a) or [[1e-3]])
    with pytest.raises(Exception, match="nosuch"):
        chunk_kernels.main(["steps", "--methods", "fp16,nosuch", "--context", "128", "--chunk", "64"])
    assert timed == []


def test_steps_sets_a_constant_and_records_it(tmp_path, monkeypatch):
    from veloxquant_mlx.cache import fused_decode

    monkeypatch.setattr(fused_decode, "MAX_LANE_ACCUMULATORS", fused_decode.MAX_LANE_ACCUMULATORS)  # restored after
    seen = []
    monkeypatch.setattr(chunk_kernels, "step_times", lambda *a, **k: seen.append(fused_decode.MAX_LANE_ACCUMULATORS) or [[1e-3]])
    out = tmp_path / "steps.json"
    assert chunk_kernels.main(["steps", "--methods", "kivi", "--context", "128", "--chunk", "64",
                               "--set", "fused_decode.MAX_LANE_ACCUMULATORS=64", "--out", str(out)]) == 0
    assert seen == [64]
    assert json.loads(out.read_text())["constants_set"] == {
        "veloxquant_mlx.cache.fused_decode.MAX_LANE_ACCUMULATORS": {"default": 32, "set": 64}}


def test_profile_refuses_a_setting_that_is_no_constant(capsys):
    with pytest.raises(SystemExit):
        chunk_kernels.parse_args(["profile", "--method", "kivi", "--set", "fused_decode.NO_SUCH=1"])
    assert "has no integer or boolean constant NO_SUCH" in capsys.readouterr().err
