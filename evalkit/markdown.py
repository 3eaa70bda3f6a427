"""The markdown the benchmark scripts write: tables, and their sections
spliced into pages that other scripts write too."""

from __future__ import annotations


def row(cells) -> str:
    return "|" + "|".join(f" {c} " if str(c) else " " for c in cells) + "|"


def table(header: list, rows: list, align: str | None = None) -> list[str]:
    """The lines of a table; ``align`` has one letter per column, ``r`` for a
    right-aligned one."""
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in (align or "l" * len(header))) + "|"
    return [row(header), rule, *(row(r) for r in rows)]


def splice(page: str, start: str, block: str, end: str | None = None) -> str:
    """``page`` with the part from the line ``start`` to ``end`` (included),
    or without ``end`` to the next ``## `` heading, replaced by ``block``;
    ``block`` appended if ``start`` is not there."""
    if start not in page:
        return page.rstrip("\n") + "\n\n" + block
    head, rest = page.split(start, 1)
    if end is not None:
        return head + block + rest[rest.index(end) + len(end):]
    nxt = rest.find("\n## ")
    return head + block + (rest[nxt + 1:] if nxt >= 0 else "")
