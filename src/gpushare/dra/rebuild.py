"""A prepared claim whose host side is gone, made again: after a reboot, for one.

The kubelet keeps a claim's "prepared" flag in memory only: after its restart, or the
node's reboot, it calls NodePrepareResources again for every claim of the pods it runs
(kubernetes/kubernetes#141966). A reboot also empties every tmpfs: ``/var/run/cdi``,
where the claim's CDI spec is; the cache tmpfs on ``<host-lib-dir>/containers``, where
its cache, holder and MPS marker directories are; the MPS pipe directories where they
are on one. The checkpoint (on disk, ``<host-lib-dir>/dra``) survives and says the claim
is prepared. Answering from it alone is the bug other drivers had
(kubernetes/kubernetes#141433, kubernetes-sigs/dra-example-driver#259): the runtime
cannot resolve a CDI name whose spec is gone, and the pod stays in
``CreateContainerError`` for ever.

So a prepare that finds a prepared claim's entry first checks its host side, and makes
again what is missing or not what the entry says, the same as at first: the CDI spec
from the document the entry keeps (written again, it is the same bytes), the
directories where the entry says (empty: what a container wrote there went with the
tmpfs), the MPS namespace capped as at first. Decided first (:func:`plan_rebuild`,
pure, over :class:`HostFound`, the facts :func:`host_found` reads), then applied
(:func:`apply_rebuild`). The claim's entry, its limits and what it counts on its card
do not change: nothing is counted twice, and nothing is asked of the API server.

An entry written before entries kept their spec has no document: its claim cannot be
rebuilt exactly, and is prepared again from the API server instead, keeping its
directories (:attr:`Rebuild.replan`; ``ClaimPreparer``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpushare.base.atomicfile import read_small_file
from gpushare.dra.checkpoint import ClaimEntry
from gpushare.dra.recovery import MAX_SPEC_BYTES
from gpushare.host.grants import GrantHost, HostNeeds, NodeDirs, needs_from_record


@dataclass(frozen=True)
class HostFound:
    """What the node holds now of one prepared claim's host side (facts, read first)."""

    #: the claim's CDI spec as read; None when it is missing or cannot be read
    spec: Mapping[str, Any] | None
    #: why ``spec`` is None ("missing", "unreadable: ..."); "" when it was read
    spec_problem: str
    #: of the directories the entry names, those that are there (real directories)
    present: frozenset[Path]


@dataclass(frozen=True)
class Rebuild:
    """What to make again for one prepared claim, and what was found missing."""

    lost: tuple[str, ...]  # each thing found missing or changed, in words (the log line)
    spec: Mapping[str, Any] | None = None  # the spec's document to write again; None: keep
    needs: tuple[HostNeeds, ...] = ()  # directories (and MPS namespaces) to make again
    #: the entry keeps no spec (written before): prepare the claim again from the API server
    replan: bool = False


def _asked(entry: ClaimEntry, dirs: NodeDirs) -> Iterator[Path]:
    """Every directory the entry's host side is made of (and, for an entry that does not
    say which kind each key is, every place one of its keys can be)."""
    for record in entry.made:
        for name in ("cache_dir", "holder", "mps_pipe"):
            if isinstance(record.get(name), str):
                yield Path(record[name])
        if isinstance(record.get("key"), str) and record.get("mps") is not None:
            yield dirs.cache_dir(record["key"])  # the namespace's marker
    if not entry.made:
        for key in entry.cache_keys:
            if "/" not in key:
                yield dirs.cache_dir(key)
                yield dirs.holder(key)


def host_found(entry: ClaimEntry, spec_path: Path, dirs: NodeDirs) -> HostFound:
    """The facts :func:`plan_rebuild` decides on: the claim's spec as read (bounded, no
    link followed, never blocking) and which of its directories are there."""
    spec: Mapping[str, Any] | None = None
    problem = ""
    try:
        data = json.loads(read_small_file(spec_path, MAX_SPEC_BYTES))
        if isinstance(data, dict):
            spec = data
        else:
            problem = "unreadable: not a spec"
    except FileNotFoundError:
        problem = "missing"
    except (OSError, ValueError, RecursionError) as exc:
        problem = f"unreadable: {str(exc)[:200]}"
    present = frozenset(p for p in _asked(entry, dirs) if p.is_dir() and not p.is_symlink())
    return HostFound(spec, problem, present)


def _missing(need: HostNeeds, present: frozenset[Path], dirs: NodeDirs) -> HostNeeds | None:
    """The part of ``need`` that is not there (None: all of it is)."""
    cache = need.cache_dir if need.cache_dir is not None and need.cache_dir not in present else None
    holder = need.holder if need.holder is not None and need.holder not in present else None
    namespace = need.mps is not None and (
        dirs.cache_dir(need.key) not in present
        or (need.mps_pipe is not None and need.mps_pipe not in present)
    )
    if cache is None and holder is None and not namespace:
        return None
    return replace(
        need,
        cache_dir=cache,
        holder=holder,
        mps=need.mps if namespace else None,
        mps_pipe=need.mps_pipe if namespace else None,
    )


def _lost_words(need: HostNeeds) -> list[str]:
    words = []
    if need.cache_dir is not None:
        words.append(f"cache directory {need.key}")
    if need.holder is not None:
        words.append(f"holder directory {need.key}")
    if need.mps is not None:
        words.append(f"MPS namespace {need.key}")
    return words


def plan_rebuild(entry: ClaimEntry, found: HostFound, dirs: NodeDirs) -> Rebuild | None:
    """What to make again of prepared claim ``entry``'s host side, given what is there
    (``found``) and where the node keeps it (``dirs``); None when nothing is missing.
    ValueError when the entry names a directory elsewhere than ``dirs`` puts it (the
    host directory changed, or the entry is not this daemon's): nothing is made. Pure."""
    if entry.spec is None:
        lost = [] if found.spec is not None else [f"spec {found.spec_problem}"]
        keys = [k for k in entry.cache_keys if "/" not in k]
        lost += [
            f"directory {k}"
            for k in keys
            if dirs.cache_dir(k) not in found.present and dirs.holder(k) not in found.present
        ]
        return Rebuild(tuple(lost), replan=True) if lost else None
    lost = []
    spec = None
    if found.spec != entry.spec:
        lost.append(f"spec {found.spec_problem or 'changed'}")
        spec = entry.spec
    needs = []
    for record in entry.made:
        need = _missing(needs_from_record(record, dirs), found.present, dirs)
        if need is not None:
            needs.append(need)
            lost += _lost_words(need)
    return Rebuild(tuple(lost), spec, tuple(needs)) if lost else None


def apply_rebuild(host: GrantHost, cdi_dir: Path, kind: str, name: str, rebuild: Rebuild) -> None:
    """Make what ``rebuild`` says (HostGrantError if a part cannot be made): the
    directories first, then the spec that names them, as a prepare does."""
    for need in rebuild.needs:
        host.make(need)
    if rebuild.spec is not None:
        host.write_claim_document(cdi_dir, kind, name, rebuild.spec)
