"""What the DRA driver finds on the node that its checkpoint does not account for.

The checkpoint is one entry per prepared claim (:mod:`gpushare.dra.checkpoint`); the
things an entry names are the claim's CDI spec (``<cdi dir>/<kind>_<uid>.json``) and its
cache directories (``<host-lib-dir>/containers/d-<key>``). They can disagree after a
daemon killed half-way through a prepare, a power cut, an emptied or moved state
directory, or something planted in either directory. The rules, none of which ever
removes what a running container may use:

* **A CDI spec is the proof that a container may run with a claim** (the runtime
  reads it when the container starts). A spec no entry names is *kept*: its entry is
  recovered from the spec itself (state ``recovered``: the cache directories its
  mounts name, the limits its environment carries) and held until the kubelet
  unprepares that claim, which it does for every claim it prepared once the pod ends.
* **An entry that cannot be read** (torn, not ours, a link or a FIFO in its place) is
  set aside (``<uid>.json.unusable``) and recovered from the claim's spec the same way;
  with no spec it named nothing a container can use, and is dropped. Other claims are
  never held up by it.
* **A cache directory that neither an entry nor a spec names** was never handed to a
  container (a prepare writes the directory, then the spec, then the entry): removed.
* **Anything else in the CDI directory** (a directory or a FIFO named like a spec, a
  spec that does not parse) is reported and left alone; nothing on the node makes
  start-up fail.

Every read is bounded, never follows a link and never blocks
(:func:`~gpushare.base.atomicfile.read_small_file`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import structlog

from gpushare.base.atomicfile import NotARegularFile, read_small_file
from gpushare.dra.checkpoint import (
    PREPARED,
    RECOVERED,
    Checkpoint,
    CheckpointError,
    ClaimEntry,
    PreparedDevice,
)
from gpushare.host.cdi import spec_file_name
from gpushare.host.claimholders import holder_dir, holders_root, release_holder_dir
from gpushare.host.library import CLAIM_KEY_PREFIX, cache_root, release_cache_dir
from gpushare.share import answers

log = structlog.get_logger(__name__)

#: The largest claim spec read back (one of ours is a few KiB per device).
MAX_SPEC_BYTES = 1 << 20
#: What a recovered entry shows for the claim's namespace (its spec does not say).
UNKNOWN_NAMESPACE = "unknown"
_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,63}$")
_MIB = re.compile(r"^([0-9]{1,9})m$")


def _env(device: dict[str, Any]) -> dict[str, str]:
    edits = device.get("containerEdits")
    entries = edits.get("env") if isinstance(edits, dict) else None
    pairs = (str(e).split("=", 1) for e in entries or () if "=" in str(e))
    return {k: v for k, v in pairs}


def _mount_paths(device: dict[str, Any]) -> list[str]:
    edits = device.get("containerEdits")
    mounts = edits.get("mounts") if isinstance(edits, dict) else None
    return [str(m.get("hostPath")) for m in mounts or () if isinstance(m, dict)]


def _holder_paths(device: dict[str, Any]) -> list[str]:
    """The ``--holder`` directories the device's hooks name (a ``driver`` card's share)."""
    edits = device.get("containerEdits")
    hooks = edits.get("hooks") if isinstance(edits, dict) else None
    found = []
    for hook in hooks or ():
        args = hook.get("args") if isinstance(hook, dict) else None
        if isinstance(args, list) and "--holder" in args[:-1]:
            found.append(str(args[args.index("--holder") + 1]))
    return found


class Leftovers:
    """Reads, recovers and tidies what the checkpoint and the two directories hold.
    Callers hold the node lock."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        cdi_dir: Path,
        cdi_kind: str,
        host_lib_dir: Path,
        pool: str,
        device_names: Callable[[], Iterable[str]],
    ) -> None:
        self.checkpoint = checkpoint
        self.cdi_dir = cdi_dir
        self.cdi_kind = cdi_kind
        self.host_lib_dir = host_lib_dir
        self.pool = pool
        self.device_names = device_names

    def spec_path(self, uid: str) -> Path:
        return self.cdi_dir / spec_file_name(self.cdi_kind, uid)

    # ------------------------------------------------------------------ one claim
    def recover(self, uid: str) -> ClaimEntry | None:
        """The entry rebuilt from ``uid``'s CDI spec (state ``recovered``); None when
        there is no spec. OSError (:class:`NotARegularFile` too) or ValueError when
        what is there cannot be read as one of ours."""
        try:
            raw = read_small_file(self.spec_path(uid), MAX_SPEC_BYTES)
        except FileNotFoundError:
            return None
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise ValueError(f"the CDI spec of claim {uid} is not JSON: {str(exc)[:200]}") from None
        devices = data.get("devices") if isinstance(data, dict) else None
        if not isinstance(devices, list):
            raise ValueError(f"the CDI spec of claim {uid} has no devices list")
        root = cache_root(self.host_lib_dir)
        holders = holders_root(self.host_lib_dir)
        names = sorted(self.device_names(), key=len, reverse=True)
        keys: list[str] = []
        prepared = []
        for device in devices:
            if not isinstance(device, dict) or not isinstance(device.get("name"), str):
                continue
            cdi_name = device["name"]
            for host_path in _mount_paths(device):
                path = Path(host_path)
                if path.parent == root and path.name.startswith(CLAIM_KEY_PREFIX):
                    keys.append(path.name)
            for held in _holder_paths(device):
                path = Path(held)
                if path.parent == holders and path.name.startswith(CLAIM_KEY_PREFIX):
                    keys.append(path.name)
            env = _env(device)
            memory = _MIB.match(env.get(answers.MEMORY_LIMIT, ""))
            cores = env.get(answers.CORE_LIMIT, "0")
            offered = next((n for n in names if cdi_name.endswith(f"-{n}")), "unknown")
            prepared.append(
                PreparedDevice(
                    "",
                    self.pool,
                    offered,
                    [f"{self.cdi_kind}={cdi_name}"],
                    card=env.get(answers.VISIBLE_DEVICES, "").split(",")[0],
                    memory_mib=int(memory.group(1)) if memory else None,
                    cores=int(cores) if cores.isascii() and cores.isdigit() else None,
                )
            )
        return ClaimEntry(
            UNKNOWN_NAMESPACE,
            uid,
            RECOVERED,
            spec_name=uid,
            cache_keys=sorted(set(keys)),
            devices=prepared,
        )

    def entry(self, uid: str) -> ClaimEntry | None:
        """``uid``'s entry; one that cannot be read is set aside and recovered from the
        claim's spec (written back), or dropped when there is none. Raises OSError only
        when the checkpoint itself cannot be written."""
        try:
            return self.checkpoint.get(uid)
        except CheckpointError as exc:
            problem = str(exc)
        aside = self.checkpoint.set_aside(uid)
        try:
            recovered = self.recover(uid)
        except (OSError, ValueError) as exc:
            log.error(
                "dra_checkpoint_unusable",
                uid=uid,
                error=problem,
                set_aside=aside,
                spec_error=str(exc)[:300],
            )
            return None
        log.error(
            "dra_checkpoint_unusable",
            uid=uid,
            error=problem,
            set_aside=aside,
            recovered_from_spec=recovered is not None,
        )
        if recovered is not None:
            self.checkpoint.put(uid, recovered)
        return recovered

    def release_unknown(self, uid: str) -> bool:
        """Unprepare of a claim with no entry: what its spec names goes too (the kubelet
        says it has ended). True if anything was there."""
        try:
            recovered = self.recover(uid)
        except (OSError, ValueError) as exc:
            log.warning("claim_cdi_spec_unreadable", uid=uid, error=str(exc)[:300])
            return False
        if recovered is None:
            return False
        remove_spec_file(self.spec_path(uid))
        for key in recovered.cache_keys:
            release_cache_dir(self.host_lib_dir, key)
            release_holder_dir(holder_dir(self.host_lib_dir, key))
        return True

    # ------------------------------------------------------------------ start
    def tidy(self) -> dict[str, ClaimEntry]:
        """The start-up pass (see the module's doc); every entry held, by UID."""
        found: dict[str, ClaimEntry] = {}
        for uid in self.checkpoint.uids():
            try:
                entry = self.entry(uid)
            except (OSError, CheckpointError) as exc:
                log.error("dra_checkpoint_unusable", uid=uid, error=str(exc)[:300])
                continue
            if entry is not None:
                found[uid] = entry
        doubtful = self._adopt_specs(found)
        if doubtful:
            log.warning(
                "claim_cache_dirs_kept",
                reason="a claim spec could not be read; what it names is unknown",
                specs=doubtful[:8],
            )
        else:
            named = {k for e in found.values() for k in e.cache_keys}
            host = self.host_lib_dir
            _tidy(holders_root(host), named, lambda k: release_holder_dir(holder_dir(host, k)),
                  "claim_holder_dir")  # fmt: skip
            _tidy(cache_root(host), named, lambda k: release_cache_dir(host, k),
                  "claim_cache_dir", lambda name: name.removesuffix(".json"))  # fmt: skip
        return {u: e for u, e in found.items() if e.state in (PREPARED, RECOVERED)}

    def _adopt_specs(self, found: dict[str, ClaimEntry]) -> list[str]:
        """Recover the entry of every claim spec no entry names; the spec files that
        could not be read (they may name cache directories)."""
        prefix = spec_file_name(self.cdi_kind, "x")[: -len("x.json")]
        try:
            names = sorted(os.listdir(self.cdi_dir))
        except OSError:
            return []
        doubtful = []
        for name in names:
            uid = name[len(prefix) : -len(".json")]
            if not (name.startswith(prefix) and name.endswith(".json")) or uid in found:
                continue
            if not _UID.match(uid):
                log.warning("claim_cdi_spec_ignored", file=name, reason="not a claim UID")
                continue
            try:
                entry = self.recover(uid)
            except NotARegularFile:
                log.warning("claim_cdi_spec_ignored", file=name, reason="not a regular file")
                continue
            except (OSError, ValueError) as exc:
                log.error("claim_cdi_spec_unreadable", file=name, error=str(exc)[:300])
                doubtful.append(name)
                continue
            if entry is None:
                continue
            try:
                self.checkpoint.put(uid, entry)
            except OSError as exc:
                log.error("dra_checkpoint_not_written", uid=uid, error=str(exc)[:300])
            found[uid] = entry
            log.warning(
                "claim_recovered_from_cdi_spec",
                uid=uid,
                cache_keys=entry.cache_keys,
                hint="kept until the kubelet unprepares the claim",
            )
        return doubtful


def _tidy(
    root: Path,
    named: set[str],
    release: Callable[[str], bool],
    what: str,
    key_of: Callable[[str], str] = lambda name: name,
) -> None:
    """Release, under ``root``, what belongs to a claim key no entry names (``named``):
    a claim's cache directories and records, or its holder directories; each logged as
    ``<what>_tidied``, or ``<what>_not_tidied`` with the error."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in sorted(names):
        key = key_of(name)
        if not key.startswith(CLAIM_KEY_PREFIX) or key in named:
            continue
        try:
            if release(key):
                log.info(f"{what}_tidied", key=key)
        except (OSError, ValueError) as exc:
            log.warning(f"{what}_not_tidied", key=key, error=str(exc)[:300])


def remove_spec_file(path: Path) -> bool:
    """Remove a claim's spec file (or a link standing there); anything else there (a
    directory) is reported and left. True if a file went."""
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except IsADirectoryError:
        log.warning("claim_cdi_spec_ignored", file=path.name, reason="not a regular file")
        return False
    return True
