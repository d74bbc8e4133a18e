"""What the pods bound to this node ask for, as placement hints.

The kubelet's GetPreferredAllocation does not say which container is being admitted
or what else it will ask for. The pod specs do: a watch on the pods of this node
(see ``node.py``) feeds :class:`PodSpecBook`, and the binder asks it two questions:
does the container holding a binding want the other resource, and how much of the
other resource does the container now asking want. The answers only steer; a
container still never spans two cards without them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from gpushare.devices import Resource
from gpushare.podresources import Snapshot
from gpushare.usage import Holder

TERMINAL_PHASES = ("Succeeded", "Failed")


def _units(resources: Mapping[str, Any] | None, name: str) -> int:
    if not resources:
        return 0
    value = resources.get(name)
    try:
        return int(str(value)) if value is not None else 0
    except ValueError:
        return 0


def container_requests(container: Mapping[str, Any], prefix: str) -> dict[Resource, int]:
    """Units of each gpushare resource a container spec asks for (limits, else requests)."""
    resources = container.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    return {
        r: _units(limits, r.name_with(prefix)) or _units(requests, r.name_with(prefix))
        for r in Resource
    }


#: (namespace, name, phase, {container: requests}) of one pod.
_Entry = tuple[str, str, str, dict[str, dict[Resource, int]]]


class PodSpecBook:
    """Thread-safe record of the GPU containers of pods on this node."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        #: Called when no known pod can be the one asking; re-reads the pods, True if done.
        self.on_miss: Callable[[], bool] | None = None
        self._lock = threading.Lock()
        self._pods: dict[str, _Entry] = {}  # by pod uid

    def _entry(self, pod: Mapping[str, Any]) -> tuple[str, _Entry | None]:
        """(uid, what to keep of the pod, or None when it holds no live GPU container)."""
        meta = pod.get("metadata") or {}
        spec = pod.get("spec") or {}
        uid = str(meta.get("uid", ""))
        containers = {}
        for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
            wanted = container_requests(container, self.prefix)
            if any(wanted.values()):
                containers[str(container.get("name", ""))] = wanted
        phase = str((pod.get("status") or {}).get("phase", "Pending"))
        if not uid or not containers or phase in TERMINAL_PHASES:
            return uid, None
        return uid, (meta.get("namespace", ""), meta.get("name", ""), phase, containers)

    def update(self, pod: Mapping[str, Any]) -> None:
        """Record (or replace) a pod as the API server shows it."""
        uid, entry = self._entry(pod)
        if not uid:
            return
        with self._lock:
            if entry is None:
                self._pods.pop(uid, None)
            else:
                self._pods[uid] = entry

    def remove(self, uid: str) -> None:
        with self._lock:
            self._pods.pop(uid, None)

    def replace_all(self, pods: list[Mapping[str, Any]]) -> None:
        """Swap in a fresh list at once: a reader never sees a half-filled book."""
        fresh = {}
        for pod in pods:
            uid, entry = self._entry(pod)
            if uid and entry is not None:
                fresh[uid] = entry
        with self._lock:
            self._pods = fresh

    def __len__(self) -> int:
        with self._lock:
            return len(self._pods)

    def requests_of(self, holder: Holder) -> dict[Resource, int] | None:
        with self._lock:
            for namespace, name, _phase, containers in self._pods.values():
                if (namespace, name) == (holder.namespace, holder.pod):
                    return dict(containers.get(holder.container, {})) or None
        return None

    def other_need(self, resource: Resource, size: int, snapshot: Snapshot | None) -> int | None:
        """The other resource's units wanted by every container that could be asking now.

        Candidates are containers asking exactly ``size`` of ``resource`` that do not
        hold it yet (per the kubelet's records, when known). If they all agree, that is
        the answer; if they disagree or none is known, None.
        """
        answers = self._candidate_needs(resource, size, snapshot)
        if not answers and self.on_miss is not None and self.on_miss():
            answers = self._candidate_needs(resource, size, snapshot)
        return answers.pop() if len(answers) == 1 else None

    def _candidate_needs(
        self, resource: Resource, size: int, snapshot: Snapshot | None
    ) -> set[int]:
        answers = set()
        with self._lock:
            pods = list(self._pods.values())
        for namespace, name, _phase, containers in pods:
            for container, wanted in containers.items():
                if wanted.get(resource, 0) != size:
                    continue
                holder = Holder(namespace, name, container)
                if snapshot is not None and snapshot.devices.get(holder, {}).get(resource):
                    continue
                answers.add(wanted.get(resource.other, 0))
        return answers
