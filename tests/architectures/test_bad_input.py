"""A model the builder does not understand is refused with an error naming the model class and
what was looked for, before anything is patched."""

import mlx.nn as nn
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache

from veloxquant_mlx import KVCacheBuilder, QuantizerConfigError, patch_model_kv_cache
from veloxquant_mlx.integration import dispatch, patch_vlm_kv_cache
from tests.architectures.servable import config_for


class NoLayers(nn.Module):
    def __call__(self, x):
        return x


class OddAttention(nn.Module):
    """Attention the builder cannot read: no KV-head count under any known name."""

    def __init__(self):
        super().__init__()
        self.wqkv = nn.Linear(8, 24)


class OddLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.self_attn = OddAttention()


class OddModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = [OddLayer(), OddLayer()]


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_kv_heads = 1
        self.head_dim = 32


class Layer(nn.Module):
    def __init__(self, attention):
        super().__init__()
        if attention:
            self.self_attn = Attn()


class MismatchedHybrid(nn.Module):
    """Three attention layers, one cache-less MLP layer, but make_cache builds only 2 KVCaches."""

    def __init__(self):
        super().__init__()
        self.layers = [Layer(True), Layer(False), Layer(True), Layer(True)]

    def make_cache(self):
        return [KVCache(), ArraysCache(size=2), KVCache()]


def _state(model):
    return (model.__dict__.get("make_cache"), type(model).__dict__.get("make_cache"),
            sorted(dispatch.installed_modules()), "_veloxquant_patch" in model.__dict__)


@pytest.mark.parametrize("model, message", [
    (NoLayers(), r"NoLayers has no layer list: looked for model.layers, model.model.layers"),
    (OddModel(), r"no layer of tests.architectures.test_bad_input.OddModel \(2 layers, model caches \['KVCache'\]\).*looked for a plain "
                 r"KVCache entry whose layer has an attention module \(self_attn/.*n_kv_heads"),
    (MismatchedHybrid(), r"MismatchedHybrid.make_cache\(\) returned 3 caches for 4 layers, 2 of them "
                         r"plain KVCache, but 3 layers have readable attention"),
])
def test_refused_with_the_class_and_what_was_looked_for_and_nothing_touched(model, message):
    before = _state(model)
    with pytest.raises(QuantizerConfigError, match=message):
        KVCacheBuilder.for_model(model, config_for("kivi"))
    with pytest.raises(QuantizerConfigError, match=message):
        patch_model_kv_cache(model, config_for("kivi"))
    assert _state(model) == before


def test_vlm_patch_of_a_model_without_language_model_is_refused_untouched():
    model = OddModel()
    before = _state(model)
    with pytest.raises(QuantizerConfigError, match="OddModel has no language_model"):
        patch_vlm_kv_cache(model, config_for("kivi"))
    assert _state(model) == before


def test_not_a_config_is_refused():
    with pytest.raises(QuantizerConfigError, match="needs a KVCacheConfig, got dict"):
        patch_model_kv_cache(OddModel(), {"method": "kivi"})
