import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from veloxquant_mlx.bench.methods import parse_spec, parse_specs, with_reference
from veloxquant_mlx.cli.bench import _split_top, resolve_methods
from veloxquant_mlx.errors import QuantizerConfigError


def test_fp16_and_mlx_quantized_specs():
    assert parse_spec("fp16").kind == "fp16"
    q4 = parse_spec("mlx-q4")
    assert (q4.kind, q4.params) == ("mlx-quantized", {"bits": 4, "group_size": 64})
    assert parse_spec("mlx-q2:group_size=32").params == {"bits": 2, "group_size": 32}
    assert "2-bit g32" in parse_spec("mlx-q2:group_size=32").label


def test_our_method_spec_is_validated_by_kv_cache_config():
    spec = parse_spec("kivi:bit_width_inlier=4,kivi_group_size=64")
    assert spec.kind == "ours"
    assert spec.params["method"] == "kivi"
    assert spec.params["bit_width_inlier"] == 4 and spec.params["kivi_group_size"] == 64
    with pytest.raises(QuantizerConfigError, match="gear_bits"):
        parse_spec("kivi:gear_bits=2")  # a field of another method
    with pytest.raises(QuantizerConfigError, match="unknown"):
        parse_spec("nosuchmethod")


@pytest.mark.parametrize("bad, needle", [
    ("mlx-q7", "bits"), ("mlx-q4:group_size=48", "group_size"), ("mlx-q4:bits=2", "unknown"),
    ("fp16:x=1", "no parameters"), ("kivi:bit_width_inlier", "field=value"), ("", "non-empty"),
])
def test_bad_specs_name_what_is_allowed(bad, needle):
    with pytest.raises(QuantizerConfigError, match=needle):
        parse_spec(bad)


def test_duplicates_refused_and_reference_first():
    with pytest.raises(QuantizerConfigError, match="twice"):
        parse_specs(["mlx-q4", "mlx-q4"])
    specs = with_reference(parse_specs(["mlx-q4"]))
    assert [s.name for s in specs] == ["fp16", "mlx-q4"]
    assert [s.name for s in with_reference(parse_specs(["mlx-q8", "fp16"]))] == ["fp16", "mlx-q8"]


def test_per_layer_list_and_spec_splitting():
    spec = parse_spec("turboquant_rvq:bit_width_inlier=[2,4]")
    assert spec.params["bit_width_inlier"] == [2, 4]
    assert _split_top("fp16,kivi:bit_width_inlier=4,kivi_group_size=64,mlx-q4") == [
        "fp16", "kivi:bit_width_inlier=4,kivi_group_size=64", "mlx-q4"]
    assert resolve_methods("fp16,mlx-q4", default=[]) == ["fp16", "mlx-q4"]
    assert resolve_methods("default,mlx-q8", default=["fp16", "mlx-q8"]) == ["fp16", "mlx-q8"]


def test_open_builds_fresh_lists(tiny_model):
    with parse_spec("mlx-q4").open(tiny_model) as make_cache:
        a, b = make_cache(), make_cache()
    assert a is not b and all(type(c) is QuantizedKVCache and c.bits == 4 for c in a)
    with parse_spec("fp16").open(tiny_model) as make_cache:
        assert all(type(c) is KVCache for c in make_cache())
