"""Whether a string is an image reference a container runtime can pull.

The grammar is the one of the distribution project's ``reference`` package, which the
kubelet's runtimes use (``[host[:port]/]path[:tag][@digest]``): path components are
lower case letters and digits joined by ``.``, ``_``, ``__`` or dashes; a tag is at most
128 characters of ``[A-Za-z0-9_.-]`` not starting with ``.`` or ``-``; a digest is
``algorithm:hex`` (32 or more hex digits); the name is at most 255 characters. A
mistyped ``--image`` is refused before anything is applied, instead of a DaemonSet
whose pods stay in ``InvalidImageName``.
"""

from __future__ import annotations

import re

_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST = (
    r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*"
    r"|\[[0-9a-fA-F:]+\])(?::[0-9]+)?"
)
_TAG = r"[\w][\w.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_PATH = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_REFERENCE = re.compile(rf"(?P<name>(?:{_HOST}/)?{_PATH.pattern})(?::{_TAG})?(?:@{_DIGEST})?")
NAME_MAX = 255


def _has_host(first: str) -> bool:
    """Whether the first ``/`` component names a registry (as the runtimes decide)."""
    return "." in first or ":" in first or first == "localhost" or first != first.lower()


def problem(reference: str) -> str | None:
    """None for a valid reference, else what is wrong with it, in a few words."""
    if not reference:
        return "empty"
    if reference != reference.strip() or any(c.isspace() for c in reference):
        return "holds white space"
    match = _REFERENCE.fullmatch(reference)
    if match is None:
        first, _, rest = reference.partition("/")
        path = rest if rest and _has_host(first) else reference
        path = path.split("@", 1)[0].rsplit(":", 1)[0] if ":" in path else path.split("@", 1)[0]
        if path != path.lower():
            return "the repository path must be lower case"
        return (
            "not an image reference ([registry[:port]/]path[:tag][@sha256:digest], "
            "e.g. registry.example.com/gpushare:0.1.0)"
        )
    if len(match.group("name")) > NAME_MAX:
        return f"the name is longer than {NAME_MAX} characters"
    return None
