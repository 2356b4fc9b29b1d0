"""The fixed passage of real prose every cache is judged on (DESIGN.md, measurement protocol).

``data/pride_and_prejudice.txt``: the opening chapters of Jane Austen's *Pride and Prejudice*
(1813, public domain), as distributed in Debian's ``r-cran-janeaustenr`` 1.0.0-1 (the R
package janeaustenr, text from Project Gutenberg): the ``prideprejudice`` character vector,
one line per element, joined with newlines, from the novel's first sentence ("It is a truth
universally acknowledged") to the end of the paragraph that passes 21,000 characters (into
Chapter 4); the Gutenberg line breaks are kept. Enough text for more than 4,200 SmolLM2 tokens, so
the 4K-context speed and bytes benchmarks can use it too.
"""

from __future__ import annotations

from importlib import resources
from typing import List

PASSAGES = {"pride_and_prejudice": "pride_and_prejudice.txt"}


def load_passage(name: str = "pride_and_prejudice") -> str:
    """The text of a shipped passage."""
    if name not in PASSAGES:
        raise ValueError(f"passage is {name!r}; allowed: {sorted(PASSAGES)}")
    return resources.files("veloxquant_mlx.quality").joinpath("data", PASSAGES[name]).read_text(encoding="utf-8")


def passage_tokens(tokenizer, n_tokens: int = 512, name: str = "pride_and_prejudice") -> List[int]:
    """The first ``n_tokens`` token ids of the passage (no BOS: SmolLM2 adds none)."""
    ids = list(tokenizer.encode(load_passage(name)))
    if not 1 <= n_tokens <= len(ids):
        raise ValueError(f"n_tokens is {n_tokens}; allowed: 1..{len(ids)} (tokens in passage {name!r})")
    return ids[:n_tokens]
