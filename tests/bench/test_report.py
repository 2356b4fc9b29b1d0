import json

from veloxquant_mlx.bench import report


def test_header_names_command_machine_and_date():
    head = report.header(["veloxquant", "bench", "--contexts", "512"])
    assert head["command"] == "veloxquant bench --contexts 512"
    assert head["date"].endswith("+00:00")
    machine = head["machine"]
    for key in ("platform", "cpu", "cpu_count", "python", "mlx_lm", "backend", "ld_preload"):
        assert key in machine
    assert machine["backend"]["mlx"] and "default_device" in machine["backend"]


def _speed_case(spec, kind, context, tps):
    stat = {"median": tps, "min": tps * 0.9, "max": tps * 1.1, "n": 3}
    return {"spec": spec, "label": spec, "kind": kind, "context": context,
            "decode_tps": stat, "prefill_tps": {k: v * 10 if k != "n" else v for k, v in stat.items()}}


def test_json_and_plots_are_written(tmp_path):
    result = {
        **report.header(["x"]),
        "speed": {"cases": [_speed_case(s, k, c, t / c ** 0.2)
                            for s, k, t in (("fp16", "fp16", 900), ("kivi", "ours", 800))
                            for c in (512, 2048)]},
        "quality": [
            {"spec": "fp16", "label": "fp16", "kind": "fp16", "kl_mean": 0.0, "top1": 1.0,
             "top1_agreement": 1.0, "bytes_ratio_vs_fp16": 2.0},
            {"spec": "kivi", "label": "kivi", "kind": "ours", "kl_mean": 0.05, "top1": 0.9,
             "top1_agreement": 0.9, "bytes_ratio_vs_fp16": 0.2},
            {"spec": "bad", "label": "bad", "kind": "ours", "error": "boom"},
        ],
    }
    path = report.write_json(result, tmp_path / "sub" / "r.json")
    assert json.loads(path.read_text())["command"] == "x"
    made = report.plot_all(result, path)
    assert sorted(p.name for p in made) == ["r_quality.png", "r_speed.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in made)
    # Redraw from the file alone, as done for GPU results.
    for p in made:
        p.unlink()
    assert report.main([str(path)]) == 0
    assert (tmp_path / "sub" / "r_speed.png").exists()


def test_no_data_no_plot(tmp_path):
    assert report.plot_all({"cases": []}, tmp_path / "e.json") == []


def test_a_default_runs_eleven_series_get_eleven_styles():
    # A default bench run draws fp16, mlx-lm's three quantized caches and our seven methods:
    # the default colour cycle of 10 gave the 11th line the 1st's colour.
    styles = [report.series_style(i, 11) for i in range(11)]
    assert len({color for color, _ in styles}) == 11
    assert len({marker for _, marker in styles}) == 10  # markers cycle, beside the colours
    assert report.series_style(3, 4)[0] != report.series_style(2, 4)[0]
