"""Width-aware tables and the short forms every view shares.

Strings in cells may come from peers (run names, islands): they are shown as plain text with
terminal controls replaced (``clean``), never parsed as rich markup. A table here is built for a known width (the console's): columns that do not fit are dropped in
a fixed order before anything is cut, free-text columns shrink with an ellipsis, and numbers and
ids never wrap. Views at 80 columns show everything; at 40 they keep the key columns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from rich import box
from rich.cells import cell_len
from rich.table import Table
from rich.text import Text

# The visible tail of a peer id: ed25519 libp2p ids all begin "12D3KooW", so the end is what
# tells peers apart (8 base58 characters: 58**8 ≈ 1.3e14 values).
PEER_ID_TAIL = 8
# Cells between two columns: one of padding and one of the (blank) divider.
COLUMN_GAP = 2
# A free-text column is not cut below this many cells (or its content's width, if smaller).
MIN_SHRINK = 8

Cell = str | Text


_BIDI_CONTROLS = {0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A)}


def _printable(ch: str) -> str:
    if ch in "\t\n\r":
        return " "
    code = ord(ch)
    if code < 0x20 or 0x7F <= code < 0xA0 or code in _BIDI_CONTROLS:
        return "\ufffd"
    return ch


def clean(s: str) -> str:
    """One line of printable text: whitespace controls become spaces, other controls and
    bidi overrides U+FFFD."""
    return "".join(map(_printable, s))


def short_peer_id(peer_id: str) -> str:
    """The one form a peer id takes in tables and log lines: ``…`` and its last 8 characters.

    The full id is printed only where a user copies it (``keys show``, the ``join`` and
    ``bootstrap`` banners, multiaddrs) and in every ``--json`` output.
    """
    return peer_id if len(peer_id) <= PEER_ID_TAIL + 1 else "…" + peer_id[-PEER_ID_TAIL:]


@dataclass(frozen=True)
class Column:
    header: str
    justify: Literal["left", "right"] = "left"
    drop: int = 0  # 0: always shown; when the width is short, the highest drop goes first
    shrink: bool = False  # free text (names, notes): cut with "…" to fit, never below MIN_SHRINK
    style: str = ""


def _text(cell: Cell) -> Text:
    """Strings from peers are shown as they are: no rich markup, no terminal controls."""
    return Text(clean(cell)) if isinstance(cell, str) else cell


def fitted_table(columns: Sequence[Column], rows: Sequence[Sequence[Cell]], width: int) -> Table:
    """A table of ``rows`` (one cell per column) whose lines fit in ``width`` cells.

    Drops droppable columns, highest ``drop`` first, until the fixed columns plus the shrinkable
    ones at their minimum fit; shrinkable columns then share what is left. A table that cannot
    fit even with only its ``drop=0`` columns is rendered as is (rich cuts it).
    """
    texts = [[_text(cell) for cell in row] for row in rows]
    natural = [
        max([cell_len(c.header), *(t[i].cell_len for t in texts)]) for i, c in enumerate(columns)
    ]
    keep = list(range(len(columns)))

    def needed(idx: list[int]) -> int:
        cells = sum(min(natural[i], MIN_SHRINK) if columns[i].shrink else natural[i] for i in idx)
        return cells + COLUMN_GAP * (len(idx) - 1)

    while needed(keep) > width:
        droppable = [i for i in keep if columns[i].drop > 0]
        if not droppable:
            break
        keep.remove(max(droppable, key=lambda i: (columns[i].drop, i)))
    flexible = [i for i in keep if columns[i].shrink]
    spare = width - sum(natural[i] for i in keep if not columns[i].shrink)
    spare -= COLUMN_GAP * (len(keep) - 1)
    share: dict[int, int] = {}
    for n, i in enumerate(sorted(flexible, key=lambda i: natural[i])):
        fair = max(spare // (len(flexible) - n), min(natural[i], MIN_SHRINK))
        share[i] = min(natural[i], fair)
        spare -= share[i]

    table = Table(
        box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, collapse_padding=True, expand=False
    )
    for i in keep:
        c = columns[i]
        table.add_column(
            c.header,
            justify=c.justify,
            style=c.style or None,
            no_wrap=True,
            overflow="ellipsis",
            max_width=share.get(i),
        )
    for t in texts:
        table.add_row(*(t[i] for i in keep))
    return table
