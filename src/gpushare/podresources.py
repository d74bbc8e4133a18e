"""The kubelet's records of who holds which devices (PodResources API, ``v1.List``).

This is gpushare's only source of truth about allocations: there is no private
checkpoint, so a daemon restarted in the middle of a busy node (even by ``kill -9``)
agrees with the kubelet at once. The kubelet rate-limits the API, so calls go
through a small token bucket; a missing or failing socket yields ``None`` and a log
line, never an exception.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog

from gpushare._proto.podresources.v1 import api_pb2, api_pb2_grpc
from gpushare.devices import SEPARATOR, Resource
from gpushare.usage import Holder

log = structlog.get_logger(__name__)

LIST_TIMEOUT = 2.0
#: The kubelet allows about 100 requests per second with a burst of 10; stay well below.
DEFAULT_RATE = 20.0
DEFAULT_BURST = 5


@dataclass(frozen=True)
class Snapshot:
    """One List answer, restricted to gpushare's resources."""

    taken_at: float
    # (resource, device ID) -> the container holding it
    holders: dict[tuple[Resource, str], Holder] = field(default_factory=dict)
    # container -> resource -> device IDs
    devices: dict[Holder, dict[Resource, list[str]]] = field(default_factory=dict)
    # exclusive resources (whole cards, MIG): full resource name -> device ID -> holder
    exclusive: dict[str, dict[str, Holder]] = field(default_factory=dict)

    def holder_of(self, resource: Resource, device_id: str) -> Holder | None:
        return self.holders.get((resource, device_id))

    def used_by_card(self) -> dict[Resource, dict[str, list[int]]]:
        """Per resource and card, the unit numbers some container holds."""
        used: dict[Resource, dict[str, list[int]]] = {r: {} for r in Resource}
        for resource, device_id in self.holders:
            uuid, _, number = device_id.rpartition(SEPARATOR)
            if number.isdigit():
                used[resource].setdefault(uuid, []).append(int(number))
        return used

    def holders_by_card(self) -> dict[str, dict[Holder, dict[Resource, int]]]:
        """Per card, each container on it and how many units of each resource it holds."""
        cards: dict[str, dict[Holder, dict[Resource, int]]] = {}
        for (resource, device_id), holder in self.holders.items():
            uuid = device_id.rpartition(SEPARATOR)[0]
            units = cards.setdefault(uuid, {}).setdefault(holder, {})
            units[resource] = units.get(resource, 0) + 1
        return cards


def parse_list_response(
    response: api_pb2.ListPodResourcesResponse,
    resources: Mapping[str, Resource],
    taken_at: float,
    exclusive: Collection[str] = (),
) -> Snapshot:
    """Keep only the devices of our resources (``resources``: full name -> Resource;
    ``exclusive``: full names of the exclusive resources)."""
    snapshot = Snapshot(taken_at)
    for pod in response.pod_resources:
        for container in pod.containers:
            holder = Holder(pod.namespace, pod.name, container.name)
            for devices in container.devices:
                resource = resources.get(devices.resource_name)
                if resource is None:
                    if devices.resource_name in exclusive:
                        held = snapshot.exclusive.setdefault(devices.resource_name, {})
                        held.update(dict.fromkeys(devices.device_ids, holder))
                    continue
                ids = list(devices.device_ids)
                snapshot.devices.setdefault(holder, {}).setdefault(resource, []).extend(ids)
                for device_id in ids:
                    snapshot.holders[(resource, device_id)] = holder
    return snapshot


class PodResourcesClient:
    """Reads the kubelet's PodResources List, politely."""

    def __init__(
        self,
        socket: Path,
        resources: Mapping[str, Resource],
        *,
        rate: float = DEFAULT_RATE,
        burst: int = DEFAULT_BURST,
        clock: Callable[[], float] = time.monotonic,
        exclusive: Collection[str] = (),
    ) -> None:
        self.socket = socket
        self.resources = dict(resources)
        self.exclusive = frozenset(exclusive)
        self._rate = rate
        self._burst = float(burst)
        self._tokens = float(burst)
        self._refilled = clock()
        self._clock = clock
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None
        self._stub: api_pb2_grpc.PodResourcesListerStub | None = None
        self._failing = False
        self.last: Snapshot | None = None

    def _take_token(self) -> bool:
        now = self._clock()
        self._tokens = min(self._burst, self._tokens + (now - self._refilled) * self._rate)
        self._refilled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def list(self, *, max_age: float = 0.0) -> Snapshot | None:
        """A fresh snapshot, or the last one if it is younger than ``max_age`` seconds or
        the rate limit is reached; None when the kubelet cannot be read."""
        with self._lock:
            now = self._clock()
            if self.last is not None and now - self.last.taken_at <= max_age:
                return self.last
            if not self._take_token():
                return self.last
            if not self.socket.exists():
                self._report_failure("socket missing")
                return None
            if self._stub is None:
                self._channel = grpc.insecure_channel(f"unix://{self.socket}")
                self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
            try:
                response = self._stub.List(api_pb2.ListPodResourcesRequest(), timeout=LIST_TIMEOUT)
            except grpc.RpcError as exc:
                self._report_failure(f"{exc.code().name}: {exc.details()}")
                self._reset()
                return None
            if self._failing:
                log.info("pod_resources_readable", socket=str(self.socket))
                self._failing = False
            self.last = parse_list_response(response, self.resources, now, self.exclusive)
            return self.last

    def _report_failure(self, error: str) -> None:
        if not self._failing:
            log.warning("pod_resources_unreadable", socket=str(self.socket), error=error)
            self._failing = True

    def _reset(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._stub = None

    def close(self) -> None:
        with self._lock:
            self._reset()
