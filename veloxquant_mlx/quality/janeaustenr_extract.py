"""Rebuild ``data/pride_and_prejudice.txt`` from Debian's r-cran-janeaustenr, without R.

    apt-get download r-cran-janeaustenr && dpkg -x r-cran-janeaustenr_*.deb pkg
    python -m veloxquant_mlx.quality.janeaustenr_extract \\
        pkg/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb > pride_and_prejudice.txt

``Rdata.rdb`` is R's lazy-load database: a sequence of objects, each a 4-byte big-endian
length then a zlib stream of R's XDR serialization. Each novel is a character vector
(STRSXP, type 16) of CHARSXP lines (type 9), one per line of the Gutenberg text.
"""

from __future__ import annotations

import struct
import sys
import zlib
from typing import Dict, List

_STRSXP, _CHARSXP = 16, 9
FIRST_SENTENCE = "It is a truth universally acknowledged"
MIN_CHARS = 21_000


def character_vectors(rdb: bytes) -> List[List[str]]:
    """Every top-level character vector in a lazy-load database, in file order."""
    out, off = [], 0
    while off < len(rdb):
        stream = zlib.decompressobj()
        data = stream.decompress(rdb[off + 4 :])
        off = len(rdb) - len(stream.unused_data)
        pos = data.index(b"UTF-8") + 5  # after the serialization header's native encoding
        flags, n = struct.unpack(">II", data[pos : pos + 8])
        if flags & 0xFF != _STRSXP:
            continue
        pos += 8
        lines = []
        for _ in range(n):
            flags, length = struct.unpack(">Ii", data[pos : pos + 8])
            pos += 8
            if flags & 0xFF != _CHARSXP:
                raise ValueError(f"expected a CHARSXP at byte {pos - 8}, found type {flags & 0xFF}")
            lines.append("" if length < 0 else data[pos : pos + length].decode("utf-8"))
            pos += max(length, 0)
        out.append(lines)
    return out


def pride_and_prejudice_excerpt(rdb: bytes) -> str:
    """The shipped excerpt: from the first sentence to the paragraph end past MIN_CHARS."""
    by_title: Dict[str, List[str]] = {v[0]: v for v in character_vectors(rdb) if v}
    text = "\n".join(by_title["PRIDE AND PREJUDICE"])
    text = text[text.index(FIRST_SENTENCE) :]
    return text[: text.index("\n\n", MIN_CHARS)].rstrip() + "\n"


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        sys.stdout.write(pride_and_prejudice_excerpt(f.read()))
