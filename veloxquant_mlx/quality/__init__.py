"""KV-cache quality on a real model and real prose (DESIGN.md, measurement protocol)."""

from .kv_quality import N_PREFILL, N_TOKENS, measure_kv_quality, reference_cache, reference_run
from .passage import PASSAGES, load_passage, passage_tokens
from .result import QualityResult
from .teacher_forced import TeacherForcedRun, teacher_forced_run

__all__ = [
    "N_PREFILL",
    "N_TOKENS",
    "PASSAGES",
    "QualityResult",
    "TeacherForcedRun",
    "load_passage",
    "measure_kv_quality",
    "passage_tokens",
    "reference_cache",
    "reference_run",
    "teacher_forced_run",
]
