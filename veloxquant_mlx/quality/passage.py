"""The fixed passage of real prose every cache is judged on (DESIGN.md, measurement protocol).

``data/pride_and_prejudice.txt``: the opening chapters of Jane Austen's *Pride and Prejudice*
(1813, public domain), as distributed in Debian's ``r-cran-janeaustenr`` 1.0.0-1 (the R
package janeaustenr, text from Project Gutenberg): the ``prideprejudice`` character vector,
one line per element, joined with newlines, from the novel's first sentence ("It is a truth
universally acknowledged") to the end of the paragraph that passes 21,000 characters (into
Chapter 4); the Gutenberg line breaks are kept. Enough text for more than 4,200 SmolLM2 tokens, so
the 4K-context speed and bytes benchmarks can use it too.

``data/*_ids.json``: the protocol's token ids (``passage_tokens``) for one model file's tokenizer,
committed so the protocol runs where no tokenizer library is installed (the GPU machine lacks
``tokenizers``, through which we build the GGUF's tokenizer): ``passage_token_ids(model_file)``
reads them back and refuses them if the passage text changed since they were written.
tests/bench/test_gpu_quality.py checks them against the tokenizer wherever the weights are.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path
from typing import List

PASSAGES = {"pride_and_prejudice": "pride_and_prejudice.txt"}
# (model file name, passage name) -> the JSON file of that tokenizer's passage_tokens ids.
PASSAGE_TOKEN_IDS = {
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "pride_and_prejudice"): "pride_and_prejudice_smollm2_ids.json",
}


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


def passage_sha256(name: str = "pride_and_prejudice") -> str:
    """sha256 of the passage's UTF-8 text (ties committed token ids to the text they encode)."""
    return hashlib.sha256(load_passage(name).encode("utf-8")).hexdigest()


def passage_token_ids_record(tokenizer, model_path, n_tokens: int = 512,
                             name: str = "pride_and_prejudice") -> dict:
    """What a ``data/*_ids.json`` file holds: ``passage_tokens(tokenizer, n_tokens, name)`` with the
    model file's name and sha256 and the passage's name and sha256."""
    model_path = Path(model_path)
    digest = hashlib.sha256()
    with open(model_path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return {
        "model_file": model_path.name,
        "model_sha256": digest.hexdigest(),
        "passage": name,
        "passage_sha256": passage_sha256(name),
        "n_tokens": n_tokens,
        "token_ids": passage_tokens(tokenizer, n_tokens, name),
    }


def load_passage_token_ids_record(model_file: str = "SmolLM2-135M-Instruct.Q4_1.gguf",
                                  name: str = "pride_and_prejudice") -> dict:
    """The committed record (see ``passage_token_ids_record``) for a model file and passage."""
    key = (model_file, name)
    if key not in PASSAGE_TOKEN_IDS:
        raise ValueError(f"no committed token ids for model_file={model_file!r}, passage={name!r}; "
                         f"allowed (model_file, passage): {sorted(PASSAGE_TOKEN_IDS)}")
    text = resources.files("veloxquant_mlx.quality").joinpath("data", PASSAGE_TOKEN_IDS[key]).read_text(encoding="utf-8")
    record = json.loads(text)
    if record["passage_sha256"] != passage_sha256(name):
        # The ids would silently describe other text: regenerate them with the tokenizer.
        raise ValueError(f"{PASSAGE_TOKEN_IDS[key]}: passage_sha256 is {record['passage_sha256']}, but the "
                         f"shipped passage {name!r} hashes to {passage_sha256(name)}; rewrite the file "
                         "from passage_token_ids_record(tokenizer, model_path)")
    return record


def passage_token_ids(model_file: str = "SmolLM2-135M-Instruct.Q4_1.gguf", n_tokens: int = 512,
                      name: str = "pride_and_prejudice") -> List[int]:
    """The first ``n_tokens`` committed ids of the passage for ``model_file``'s tokenizer: what
    ``passage_tokens(tokenizer, n_tokens, name)`` gives, without a tokenizer."""
    ids = load_passage_token_ids_record(model_file, name)["token_ids"]
    if not 1 <= n_tokens <= len(ids):
        raise ValueError(f"n_tokens is {n_tokens}; allowed: 1..{len(ids)} (committed ids of passage {name!r} "
                         f"for {model_file})")
    return list(ids[:n_tokens])
