"""The daemon's own CDI spec per device-plugin grant: limits no pod spec can change.

Under a CDI device-list strategy (``cdi-cri``, ``cdi-annotations``) every Allocate
(shared units, and whole cards, MIG devices and time-sliced replicas: ``name`` is then
:func:`exclusive_grant_name`) writes one spec, ``<prefix>-grant_<name>.json`` in the daemon's CDI
directory (``--dra-cdi-dir``, the same one the DRA driver writes its claims into),
holding one CDI device ``<prefix>/grant=<name>`` whose ``containerEdits`` are the
grant's edits from the answer port (``share/answers.py``): HAMi-core's limits, the
preload, the interposer, lock and cache mounts, ``NVIDIA_VISIBLE_DEVICES``, and the
grant's OCI hooks (none yet; issue 31 adds a ``createRuntime`` hook). The Allocate
answer names that device (:func:`~gpushare.share.answers.sealed`). The runtime applies
CDI edits after the container's env and mounts from the pod spec and replaces what
they set, so a tenant's ``env: CUDA_DEVICE_MEMORY_LIMIT_0=...`` is overwritten.

``name`` is :func:`grant_name`: the resource and a digest of the exact units held
(``vcuda-memory-<20 hex>``), nothing a tenant chooses. A spec is in use exactly while a
container in the kubelet's PodResources list holds those units: :meth:`GrantSpecs.collect`
removes the others after the grace period, counted from the later of the file's last
write and the first read that missed it, re-checked under :data:`SPEC_LOCK` (which
:meth:`GrantSpecs.write` holds too), so a spec written again for a new holder of the
same units is never removed under it.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path

import structlog

from gpushare.host.cdi import claim_device, spec_file_name, write_spec
from gpushare.share.answers import ContainerEdits

log = structlog.get_logger(__name__)

GRANT_CLASS = "grant"
#: Held while a grant spec is written or removed (a rename or an unlink: never long).
SPEC_LOCK = threading.Lock()
_NAME = re.compile(r"^[a-z-]+-[0-9a-f]{20}$")


def grant_name(resource: str, device_ids: Iterable[str]) -> str:
    """``<resource>-<digest of the units>``: the CDI device name of one grant."""
    joined = "\n".join(sorted(device_ids)).encode()
    return f"{resource}-{hashlib.sha256(joined).hexdigest()[:20]}"


def exclusive_grant_name(full_resource: str, device_ids: Iterable[str]) -> str:
    """``whole-<digest of the resource and its devices>``: the CDI device name of one
    grant of an exclusive resource (whole cards, MIG devices, time-sliced replicas),
    whose full name (``gpushare.io/mig-3g.20gb``) may hold characters a spec name may not."""
    joined = "\n".join([full_resource, *sorted(device_ids)]).encode()
    return f"whole-{hashlib.sha256(joined).hexdigest()[:20]}"


class GrantSpecs:
    """The device plugin's per-grant CDI specs in one directory."""

    def __init__(self, directory: Path, prefix: str, grace_seconds: float) -> None:
        self.directory = directory
        self.kind = f"{prefix}/{GRANT_CLASS}"
        self.grace_seconds = grace_seconds
        self._prefix = spec_file_name(self.kind, "x")[: -len("x.json")]
        self._waiting_from: dict[str, float] = {}

    def cdi_name(self, name: str) -> str:
        return f"{self.kind}={name}"

    def write(self, name: str, edits: ContainerEdits) -> str:
        """Write the spec of grant ``name`` carrying ``edits``; its fully qualified CDI
        device name. OSError if it cannot be written (the Allocate is then refused)."""
        with SPEC_LOCK:
            write_spec(self.directory, self.kind, name, [claim_device(name, edits)])
        return self.cdi_name(name)

    def names_on_disk(self) -> set[str]:
        try:
            files = [p.name for p in self.directory.iterdir()]
        except OSError:
            return set()
        found = set()
        for file in files:
            if file.startswith(self._prefix) and file.endswith(".json"):
                name = file[len(self._prefix) : -len(".json")]
                if _NAME.match(name):
                    found.add(name)
        return found

    def _written(self, name: str) -> float:
        try:
            return os.stat(self.directory / spec_file_name(self.kind, name)).st_mtime
        except OSError:
            return 0.0

    def collect(self, live: set[str], now: float) -> list[str]:
        """Remove the specs of grants no container holds any more (``live``: the
        :func:`grant_name` of every holding in a fresh, successful PodResources read),
        once the grace period has passed; the names removed."""
        on_disk = self.names_on_disk()
        for name in list(self._waiting_from):
            if name not in on_disk or name in live:
                del self._waiting_from[name]
        removed = []
        for name in sorted(on_disk - live):
            since = self._waiting_from.setdefault(name, max(now, self._written(name)))
            if now - since <= self.grace_seconds:
                continue
            with SPEC_LOCK:
                written = self._written(name)
                if written > since:  # written again for a new holder of the same units
                    self._waiting_from[name] = written
                    continue
                try:
                    (self.directory / spec_file_name(self.kind, name)).unlink(missing_ok=True)
                except OSError as exc:
                    log.warning("grant_spec_not_removed", name=name, error=str(exc))
                    continue
            del self._waiting_from[name]
            removed.append(name)
            log.info("grant_spec_removed", name=name, grace_seconds=self.grace_seconds)
        return removed
