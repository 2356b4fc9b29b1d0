import argparse
import json

import pytest

from veloxquant_mlx.cli import bench


def _args(*argv):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_bench_on_a_random_model_writes_self_describing_results(tmp_path, capsys):
    out = tmp_path / "b.json"
    code = bench.run(_args("--random-model", "tiny", "--parts", "memory,speed", "--methods",
                           "mlx-q4,mlx-q2:group_size=32", "--contexts", "64", "--repeats", "1",
                           "--decode-tokens", "2", "--warmup-tokens", "0", "--out", str(out), "--quiet"))
    assert code == 0
    result = json.loads(out.read_text())
    assert [s["name"] for s in result["specs"]] == ["fp16", "mlx-q4", "mlx-q2:group_size=32"]
    assert result["model"]["random_model"] == "tiny" and result["machine"]["cpu_count"]
    assert {m["context"] for m in result["memory"]} == {64, 512}
    assert len(result["speed"]["cases"]) == 3
    assert set(result["timings_s"]) == {"memory", "speed"}
    assert (tmp_path / "b_speed.png").exists()
    table = capsys.readouterr().out
    assert "mlx-lm QuantizedKVCache 4-bit g64" in table and "decode@64" in table


@pytest.mark.parametrize("argv", [["--contexts", "1,2"], ["--parts", "speed,nope"], ["--contexts", "x"]])
def test_bad_arguments_are_usage_errors(argv):
    with pytest.raises(SystemExit) as info:
        _args(*argv)
    assert info.value.code == 2


def test_bad_spec_or_count_exits_2(tmp_path, capsys):
    assert bench.run(_args("--random-model", "tiny", "--methods", "mlx-q7", "--out", str(tmp_path / "x.json"))) == 2
    assert "mlx-q7" in capsys.readouterr().err
    assert bench.run(_args("--random-model", "tiny", "--repeats", "0", "--out", str(tmp_path / "x.json"))) == 2
    assert not (tmp_path / "x.json").exists()
