"""How a rank's slice of a tensor is cut into reads of its checkpoint file (`pieces`).

Apart from the readers (reader.py, registered.py), which both take these pieces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlaunch.cache.store.plan import SliceSpec

NARROW = 1 << 20  # a split narrower than this per row is read as whole spans (see pieces)


@dataclass(frozen=True)
class Piece:
    """One read: `rows` rows of `row` bytes at file offset `offset`; bytes [lo, lo + width) of
    each row land, packed, at byte `at` of the slice. A contiguous piece is one whole row."""

    offset: int
    rows: int
    row: int
    lo: int
    width: int
    at: int

    @property
    def span(self) -> int:
        """Bytes read from the file."""
        return self.rows * self.row

    @property
    def nbytes(self) -> int:
        """Bytes written into the slice."""
        return self.rows * self.width

    @property
    def contiguous(self) -> bool:
        """Whether every byte read is kept."""
        return self.row == self.width


def pieces(spec: SliceSpec, chunk: int, packed: bool = False) -> list[Piece]:
    """Cut a slice into reads of at most `chunk` bytes of file span each (`packed`: of at most
    `chunk` bytes kept, for reads that gather the kept bytes out of a file mapping).

    A split whose part of each row is narrower than NARROW (o_proj and down_proj at TP > 1)
    is read as spans of whole rows, the other ranks' bytes included, and split after the read
    by one strided copy: one read and one host-to-device copy per span instead of one per row.
    A wider part is read where it lies, row by row, without reading the other ranks' bytes.

    Ranks do not share reads: each rank's process reads what it holds. Sharing a span (one
    rank reads it, the others get their columns from it) would need the ranks' processes to
    coordinate and hand device memory to each other during the load; with the page cache
    warm the cost it saves is a memory copy, and gathering (VLAUNCH_SPLIT_READ=gather) avoids
    even that without coordination.
    """
    runs = spec.runs()
    if not runs:
        return []
    width = runs[0][1]
    if len(runs) > 1 and width < NARROW and (width if packed else runs[1][0] - runs[0][0]) <= chunk:
        row = runs[1][0] - runs[0][0]
        first = spec.source.begin
        per = chunk // (width if packed else row)
        return [Piece(first + i * row, min(per, len(runs) - i), row, runs[0][0] - first, width,
                      i * width) for i in range(0, len(runs), per)]
    out = []
    at = 0
    for offset, length in runs:
        for start in range(0, length, chunk):
            n = min(chunk, length - start)
            out.append(Piece(offset + start, 1, n, 0, n, at + start))
        at += length
    return out
