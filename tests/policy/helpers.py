"""Shared helpers of the policy tests: the default policy's text and small edits of it."""

from __future__ import annotations

from pathlib import Path

from veloxquant_mlx.policy import compile_policy_text
from veloxquant_mlx.policy.sources import default_policy_path

DEFAULT_TEXT = Path(default_policy_path()).read_text(encoding="utf-8")
GIB = 2**30


def edited(old: str, new: str, text: str = DEFAULT_TEXT) -> str:
    assert old in text, f"test bug: {old!r} not in the policy text"
    return text.replace(old, new, 1)


def compile_edit(old: str, new: str):
    return compile_policy_text(edited(old, new), "policies/x.yaml")
