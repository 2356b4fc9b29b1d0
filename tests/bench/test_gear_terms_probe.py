"""bench/gear_terms_probe.py: its template changes reach GEAR's decode launch (and leave it
after), and its options are checked."""

import mlx.core as mx
import pytest

from veloxquant_mlx.bench import gear_terms_probe
from veloxquant_mlx.cache import fused_decode
from veloxquant_mlx.cache.factory import KVCacheFactory
from veloxquant_mlx.config import KVCacheConfig


def _launched_templates(cache, queries, monkeypatch):
    """The template of the cache's next decode launch (recorded under the CUDA emulation, not run)."""
    from tests.cache import cuda_emulation

    seen = []
    launch = fused_decode.PartialsKernel.attend
    monkeypatch.setattr(fused_decode.PartialsKernel, "attend",
                        lambda self, *a, **k: seen.append(dict(k["template"])) or launch(self, *a, **k))
    with cuda_emulation.signatures_only(), cuda_emulation.emulated_kernels():
        cache.attention(queries, scale=128**-0.5)
    return seen


def test_a_variant_changes_the_launch_template_while_open(monkeypatch):
    from tests.cache.test_fused_decode_emulated import _filled

    cache = KVCacheFactory.create(KVCacheConfig(method="gear"))
    queries = _filled(cache, 600, B=1, H=2, rep=4, D=128, dtype=mx.bfloat16)
    shipped = _launched_templates(cache, queries, monkeypatch)
    assert shipped and shipped[0]["KCNT"] > 0 and shipped[0]["RANK"] > 0
    with gear_terms_probe.template_changes(gear_terms_probe.VARIANTS["no_key_outliers"] | {"OB": 8}):
        gear_terms_probe.drop_plan(cache)
        changed = _launched_templates(cache, queries, monkeypatch)
    assert changed[0] == {**shipped[0], "KCNT": 0, "OB": 8}
    gear_terms_probe.drop_plan(cache)
    assert _launched_templates(cache, queries, monkeypatch)[0] == shipped[0]


def test_options_are_checked(capsys):
    args = gear_terms_probe.parse_args(["--contexts", "4096", "--warps", "1024", "--variants", "shipped,no_rank"])
    assert (args.contexts, args.warps, args.variants) == ([4096], [1024], ["shipped", "no_rank"])
    with pytest.raises(SystemExit):
        gear_terms_probe.parse_args(["--variants", "shipped,no_lowrank"])
    err = capsys.readouterr().err
    assert "no_lowrank" in err and "no_value_outliers" in err
    with pytest.raises(SystemExit):
        gear_terms_probe.parse_args(["--warps", "0"])


def test_off_cuda_it_is_a_usage_error(capsys):
    if fused_decode._on_cuda():
        pytest.skip("this machine runs MLX on CUDA: the probe would run")
    assert gear_terms_probe.main(["--contexts", "4096", "--no-openblas"]) == 2
    assert "gear_terms_probe needs MLX's CUDA backend" in capsys.readouterr().err
