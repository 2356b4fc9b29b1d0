"""Where the packaged policies and schemas are: inside the wheel (veloxquant_mlx/_data/, put
there by pyproject's hatch force-include) or, for an editable install or a checkout, the
repository's top-level policies/ and schemas/. This is resource lookup, not a fallback: a
missing file is an error."""

from __future__ import annotations

from pathlib import Path

from veloxquant_mlx.errors import PolicyError

_PACKAGE = Path(__file__).resolve().parent.parent
_CANDIDATES = (_PACKAGE / "_data", _PACKAGE.parent)


def resource_path(folder: str, name: str) -> Path:
    """The packaged file folder/name (folder is "policies" or "schemas")."""
    for root in _CANDIDATES:
        path = root / folder / name
        if path.is_file():
            return path
    looked = ", ".join(str(root / folder / name) for root in _CANDIDATES)
    raise PolicyError(f"packaged file {folder}/{name} not found; looked in {looked}")
