"""Real models for tests and benchmarks: SmolLM2-135M-Instruct from its GGUF, or any mlx-lm model."""

from .load import load_model
from .smollm2 import (SMOLLM2_INSTALL_HINT, load_smollm2, load_smollm2_model, smollm2_available,
                      smollm2_gguf_path)

__all__ = ["load_model", "load_smollm2", "load_smollm2_model", "smollm2_available", "smollm2_gguf_path", "SMOLLM2_INSTALL_HINT"]
