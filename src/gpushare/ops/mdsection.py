"""Generated sections of a markdown file, between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->``.

``make bench`` and ``make simulate`` each rewrite their own section of
``docs/benchmarks.md`` and leave the hand-written text around it alone.
"""

from __future__ import annotations

from pathlib import Path


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def replace_section(path: Path, name: str, body: str) -> None:
    """Put ``body`` between the markers of section ``name`` in ``path``.

    The markers are appended (with the body) when the file or the section is missing.
    """
    start, end = markers(name)
    block = f"{start}\n{body.rstrip()}\n{end}"
    text = path.read_text() if path.exists() else ""
    head, found, rest = text.partition(start)
    if found:
        _old, found_end, tail = rest.partition(end)
        if not found_end:
            raise ValueError(f"{path}: {start} has no matching {end}")
        text = head + block + tail
    else:
        text = (text.rstrip() + "\n\n" if text.strip() else "") + block + "\n"
    path.write_text(text)
