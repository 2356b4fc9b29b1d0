"""veloxquant_mlx.bench.rvq_attribution: turboquant_rvq's variants on a tiny random model
(plumbing and faithfulness; the quality figures come from the real model, results/)."""

import importlib
import json

import mlx.core as mx
import pytest

from veloxquant_mlx.bench import rvq_attribution
from veloxquant_mlx.bench.layer_specs import parse_layer_spec
from veloxquant_mlx.quality import teacher_forced_run

TOKENS, PREFILL = 160, 8  # past 128 tokens the caches hold compressed blocks


def _logprobs(model, tokens, opened):
    with opened as make_cache:
        return teacher_forced_run(model, tokens, make_cache(), PREFILL).logprobs


def test_the_current_variant_reproduces_the_cache(tiny_model):
    """first_token_exact, read through its decoded K/V, gives what turboquant_rvq gives with
    the attention patch (its compressed-form attention); as_is does not (token 0 differs)."""
    tokens = mx.random.randint(0, 256, (TOKENS,), key=mx.random.key(1)).tolist()
    real = _logprobs(tiny_model, tokens, parse_layer_spec("turboquant_rvq").open(tiny_model))
    variants = rvq_attribution.VARIANTS
    now = _logprobs(tiny_model, tokens, variants["first_token_exact"].with_bits(4).open(tiny_model))
    before = _logprobs(tiny_model, tokens, variants["as_is"].with_bits(4).open(tiny_model))
    assert mx.abs(now - real).max().item() < 1e-4
    assert mx.abs(before - real).max().item() > 10 * mx.abs(now - real).max().item()


def test_half_exact_variant_returns_exact_keys():
    variant = rvq_attribution.VARIANTS["values_only_quantized"].with_bits(4)
    cache = variant.make()
    k, v = (mx.random.normal((1, 1, 200, 64), key=mx.random.key(s)) for s in (2, 3))
    cache.update_and_fetch(k[:, :, :199], v[:, :, :199])
    keys, values = cache.update_and_fetch(k[:, :, 199:], v[:, :, 199:])  # 128 tokens encoded
    assert cache.codec.n_compressed == 128
    assert mx.array_equal(keys, k).item()
    assert 0 < mx.abs(values - v).max().item() < 0.5
    assert cache.nbytes == cache.codec.nbytes


def test_module_runs_tiny_random_model(tmp_path):
    out = tmp_path / "attr.json"
    argv = ["--random-model", "tiny", "--tokens", str(TOKENS), "--prefill", str(PREFILL),
            "--from-row", "140", "--variants", "as_is,keys_only_quantized,stage1_group32",
            "--bits", "3", "--no-openblas", "--out", str(out)]
    assert rvq_attribution.main(argv) == 0
    result = json.loads(out.read_text())
    assert result["command"] and result["machine"]["cpu_count"] and result["settings"]["bits"] == 3
    assert [v["name"] for v in result["variants"]] == ["as_is", "keys_only_quantized", "stage1_group32"]
    for row in result["results"].values():
        assert "error" not in row
        assert row["all_decoded"]["rows"] == TOKENS - PREFILL and row["from_row"]["rows"] == 19
        assert row["all_decoded"]["kl_mean"] > 0 and row["nbytes_after_run"] > 0


@pytest.mark.parametrize("argv", [["--variants", "as_is,nope"], ["--bits", "5"], ["--variants", ""]])
def test_bad_arguments_are_usage_errors(argv):
    with pytest.raises(SystemExit) as info:
        rvq_attribution.parse_args(argv)
    assert info.value.code == 2


def test_help_names_every_variant(capsys):
    module = importlib.import_module("veloxquant_mlx.bench.rvq_attribution")
    with pytest.raises(SystemExit):
        module.main(["--help"])
    text = capsys.readouterr().out
    assert all(name in text for name in rvq_attribution.VARIANTS)
