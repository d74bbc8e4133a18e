"""Per-card choice by pod annotation: ``use-gputype``, ``nouse-gputype``,
``use-gpuuuid``, ``nouse-gpuuuid`` (HAMi's annotations, under ``<prefix>/`` or
``nvidia.com/``).

* ``use-gputype: "A100,H100"``: only cards whose name contains one of these
  (case-insensitive substring);
* ``nouse-gputype: "T4"``: no card whose name contains one of these;
* ``use-gpuuuid`` / ``nouse-gpuuuid``: only / never these card UUIDs (exact, any case).

The pure part is :class:`CardChoice`. The daemon learns which pod is being admitted
only from the pod specs: :class:`ChoiceBook` keeps the pending pods of the node and
answers "which choice applies to the container now asking ``n`` of this resource?"
when every candidate container agrees (see docs/modes.md); otherwise nothing is
narrowed and the scheduler extender's choice of node stands.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.base.quantity import whole_units

NAMES = ("use-gputype", "nouse-gputype", "use-gpuuuid", "nouse-gpuuuid")
#: Besides ``<prefix>/``, the spellings users of HAMi already write.
OTHER_PREFIX = "nvidia.com"


def _items(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(p.strip().lower() for p in text.split(",") if p.strip()))


@dataclass(frozen=True)
class CardChoice:
    use_types: tuple[str, ...] = ()
    nouse_types: tuple[str, ...] = ()
    use_uuids: tuple[str, ...] = ()
    nouse_uuids: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.use_types or self.nouse_types or self.use_uuids or self.nouse_uuids)

    def allows(self, name: str, uuid: str) -> bool:
        lname, luuid = name.lower(), uuid.lower()
        if self.use_types and not any(t in lname for t in self.use_types):
            return False
        if any(t in lname for t in self.nouse_types):
            return False
        if self.use_uuids and luuid not in self.use_uuids:
            return False
        return luuid not in self.nouse_uuids

    def why_not(self, name: str, uuid: str) -> str:
        """Which annotation refuses the card (for the Allocate refusal)."""
        parts = []
        if self.use_types:
            parts.append(f"use-gputype={','.join(self.use_types)}")
        if self.nouse_types:
            parts.append(f"nouse-gputype={','.join(self.nouse_types)}")
        if self.use_uuids:
            parts.append(f"use-gpuuuid={','.join(self.use_uuids)}")
        if self.nouse_uuids:
            parts.append(f"nouse-gpuuuid={','.join(self.nouse_uuids)}")
        return f"the pod's annotations ({'; '.join(parts)}) exclude {uuid} ({name})"


def card_choice(annotations: Mapping[str, Any] | None, prefix: str) -> CardChoice:
    """The choice a pod's annotations make; both spellings are read and joined."""
    found: dict[str, tuple[str, ...]] = {}
    for name in NAMES:
        values: tuple[str, ...] = ()
        for domain in dict.fromkeys((prefix, OTHER_PREFIX)):
            text = (annotations or {}).get(f"{domain}/{name}")
            if isinstance(text, str):
                values += _items(text)
        found[name] = tuple(dict.fromkeys(values))
    return CardChoice(
        use_types=found["use-gputype"],
        nouse_types=found["nouse-gputype"],
        use_uuids=found["use-gpuuuid"],
        nouse_uuids=found["nouse-gpuuuid"],
    )


def _units(container: Mapping[str, Any], resource: str) -> int:
    resources = container.get("resources") or {}
    for kind in ("limits", "requests"):
        value = (resources.get(kind) or {}).get(resource)
        if value is not None:
            return whole_units(value) or 0
    return 0


#: (namespace, pod, container) of a container.
ContainerKey = tuple[str, str, str]


class ChoiceBook:
    """The pending pods of this node with what each container asks, and their choice.

    Fed with every pod list the API link reads (:meth:`replace_all`). Thread-safe.
    """

    def __init__(
        self,
        prefix: str,
        resources: Iterable[str],
        on_miss: Callable[[], bool] | None = None,
    ) -> None:
        self.prefix = prefix
        self.resources = tuple(resources)  # full resource names
        #: Re-reads the pods when no pending pod can be the one asking; True if it did.
        self.on_miss = on_miss
        self._lock = threading.Lock()
        # (container key, resource, units) -> the pod's choice
        self._asks: list[tuple[ContainerKey, str, int, CardChoice]] = []

    def replace_all(self, pods: Iterable[Mapping[str, Any]]) -> None:
        asks = []
        for pod in pods:
            if (pod.get("status") or {}).get("phase", "Pending") != "Pending":
                continue
            meta = pod.get("metadata") or {}
            spec = pod.get("spec") or {}
            choice = card_choice(meta.get("annotations"), self.prefix)
            for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
                key = (
                    str(meta.get("namespace", "")),
                    str(meta.get("name", "")),
                    str(container.get("name", "")),
                )
                for resource in self.resources:
                    units = _units(container, resource)
                    if units > 0:
                        asks.append((key, resource, units, choice))
        with self._lock:
            self._asks = asks

    def knows(self, namespace: str, pod: str) -> bool:
        with self._lock:
            return any(key[:2] == (namespace, pod) for key, *_rest in self._asks)

    def _candidates(
        self, resource: str, units: int, holds: Callable[[ContainerKey], bool]
    ) -> set[CardChoice]:
        with self._lock:
            asks = list(self._asks)
        return {
            choice
            for key, wanted, n, choice in asks
            if wanted == resource and n == units and not holds(key)
        }

    def choice_for(
        self, resource: str, units: int, holds: Callable[[ContainerKey], bool]
    ) -> CardChoice | None:
        """The choice of the container now asking ``units`` of ``resource``, when every
        pending container that could be asking (not yet ``holds`` it) has the same one;
        None when none does, when they differ, or when no pending pod asks that."""
        choices = self._candidates(resource, units, holds)
        if not choices and self.on_miss is not None and self.on_miss():
            choices = self._candidates(resource, units, holds)
        if len(choices) != 1:
            return None
        (choice,) = choices
        return choice or None


def allowed_cards(
    pod: Mapping[str, Any], prefix: str, cards: Iterable[tuple[str, str]]
) -> set[str] | None:
    """The UUIDs of ``cards`` ((uuid, name) pairs) the pod's annotations allow; None when
    the pod makes no choice. For the scheduler extender: a node whose cards all fail
    cannot take the pod (see docs/modes.md)."""
    choice = card_choice((pod.get("metadata") or {}).get("annotations"), prefix)
    if not choice:
        return None
    return {uuid for uuid, name in cards if choice.allows(name, uuid)}
