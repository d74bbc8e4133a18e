"""A small node for exhaustive pairing runs: the real binder and servicer, in-process.

Enumerating every admission sequence through real sockets would take hours; the
transport adds nothing to the pairing decision. So these worlds keep everything that
decides (``plugin.DevicePluginServicer`` -> ``binding.Binder`` -> ``pairing`` and
``placement``) and the kubelet stand-in that drives it (``sim.kubeletdouble``: its offer,
padding, Go-map order, records, rejections), and drop only the sockets: the servicer
is called through :class:`DirectStub`, and the binder reads the stand-in's
PodResources answer through :class:`DirectRecords`. The same sequences also run over
real sockets in smaller numbers (``test_pairing.py``).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpushare._proto.deviceplugin.v1beta1 import api_pb2
from gpushare.deviceplugin.binding import Binder
from gpushare.deviceplugin.plugin import DevicePluginServicer
from gpushare.gpu.gpus import Gpu
from gpushare.gpu.health import HealthBoard
from gpushare.kube.podspecs import PodSpecBook
from gpushare.node.podresources import parse_list_response
from gpushare.share.answers import Enforcement
from gpushare.share.devices import Inventory, Resource
from gpushare.share.placement import Policy
from gpushare.share.records import Snapshot
from gpushare.share.usage import UsageLedger
from gpushare.sim.kubeletdouble import AdmissionError, ContainerSpec, SimulatedKubelet

PREFIX = "gpushare.io"
MEMORY = Resource.MEMORY.name_with(PREFIX)
CORE = Resource.CORE.name_with(PREFIX)


_DEVICE_LISTS: dict[tuple[tuple[int, ...], Resource], list[Any]] = {}


class Aborted(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class _Context:
    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


class DirectStub:
    """The unary methods of a DevicePluginStub, calling the servicer in-process."""

    def __init__(self, servicer: DevicePluginServicer) -> None:
        self.servicer = servicer

    def GetPreferredAllocation(self, request: Any, timeout: float | None = None) -> Any:
        return self.servicer.GetPreferredAllocation(request, _Context())

    def Allocate(self, request: Any, timeout: float | None = None) -> Any:
        return self.servicer.Allocate(request, _Context())


class DirectRecords:
    """The binder's view of PodResources, read from the stand-in without a socket.

    ``failing`` makes every read fail (the socket missing, the rate limit refusing).
    """

    def __init__(self, kubelet: SimulatedKubelet, clock: Callable[[], float]) -> None:
        self.kubelet = kubelet
        self.clock = clock
        self.last: Snapshot | None = None
        self.last_error = ""
        self.failing = False
        self.reads = 0

    def read_after(self, not_before: float, *, timeout: float) -> Snapshot | None:
        if self.failing:
            self.last_error = "UNAVAILABLE: socket missing"
            return None
        self.reads += 1
        began = self.clock()
        snapshot = parse_list_response(
            self.kubelet.list_response(), {MEMORY: Resource.MEMORY, CORE: Resource.CORE}, began
        )
        self.last = snapshot
        return snapshot


@dataclass(frozen=True)
class Regime:
    name: str
    records: bool
    specs: bool


REGIMES = (
    Regime("no PodResources", records=False, specs=False),
    Regime("PodResources only", records=True, specs=False),
    Regime("PodResources and pod specs", records=True, specs=True),
)


@dataclass
class Outcome:
    admitted: int = 0
    split: int = 0
    refused: int = 0  # by the plugin (Allocate error)
    needless: int = 0  # refused by the plugin although one card could hold the container
    #: refused because the container asks cores and no memory units (the daemon's rule): a
    #: refusal by rule, not for want of room; never counted as needless
    core_only: int = 0
    insufficient: int = 0  # refused by the kubelet's own count (no plugin call decides it)
    details: list[str] = field(default_factory=list)

    def add(self, other: Outcome) -> None:
        self.admitted += other.admitted
        self.split += other.split
        self.refused += other.refused
        self.needless += other.needless
        self.core_only += other.core_only
        self.insufficient += other.insufficient
        self.details.extend(other.details[:3])


class World:
    """Cards, the kubelet stand-in and the real binder, with a manual clock."""

    def __init__(
        self,
        memory_mib: Sequence[int],
        regime: Regime,
        *,
        policy: Policy = Policy.BINPACK,
        seed: int | None = 0,
    ) -> None:
        self.regime = regime
        self.now = 1000.0
        gpus = [
            Gpu(uuid=f"GPU-{i}", name="Test", memory_mib=mib, index=i, minor=i)
            for i, mib in enumerate(memory_mib)
        ]
        self.inventory = Inventory(gpus, 256)
        self.health = HealthBoard(self.inventory.cards)
        self.usage = UsageLedger(self.inventory, clock=self.clock)
        self.kubelet = SimulatedKubelet(Path("/nonexistent"), seed=seed)
        self.records = DirectRecords(self.kubelet, self.clock) if regime.records else None
        self.specs = PodSpecBook(PREFIX) if regime.specs else None
        #: The API server's pods; the book re-reads them on a miss while ``api_up``.
        self.api_pods: dict[str, dict[str, Any]] = {}
        self.api_up = True
        if self.specs is not None:
            self.specs.on_miss = self._relist
        self.binder = Binder(
            self.inventory,
            self.usage,
            self.health,
            policy=policy,
            enforcement=Enforcement(library=None, preload_file=None, use_ld_preload_env=False),
            host_lib_dir=Path("/nonexistent"),
            records=self.records,
            specs=self.specs,
            clock=self.clock,
        )
        stopping = threading.Event()
        options = api_pb2.DevicePluginOptions(get_preferred_allocation_available=True)
        for resource in Resource:
            servicer = DevicePluginServicer(resource, self.binder, self.health, stopping)
            key = (tuple(memory_mib), resource)
            if key not in _DEVICE_LISTS:  # the same for every world of these cards
                _DEVICE_LISTS[key] = list(servicer.device_list().devices)
            self.kubelet.attach(
                resource.name_with(PREFIX), DirectStub(servicer), options, _DEVICE_LISTS[key]
            )
        self.pods = 0

    def _relist(self) -> bool:
        if not self.api_up or self.specs is None:
            return False
        self.specs.replace_all(list(self.api_pods.values()))
        return True

    def clock(self) -> float:
        self.now += 0.001  # every look at the clock is a moment later: admissions are quick
        return self.now

    def free(self) -> dict[str, tuple[int, int]]:
        used: dict[str, list[int]] = {uuid: [0, 0] for uuid in self.inventory.cards}
        for record in self.kubelet.admitted.values():
            for resource, ids in record.devices.items():
                for device_id in ids:
                    used[device_id.split("::")[0]][0 if resource == MEMORY else 1] += 1
        return {
            uuid: (card.memory_units - used[uuid][0], 100 - used[uuid][1])
            for uuid, card in self.inventory.cards.items()
        }

    def pod_fits(self, containers: Sequence[ContainerSpec]) -> bool:
        """Whether some assignment of these containers to cards, each whole, fits now."""
        needs = [(c.requests.get(MEMORY, 0), c.requests.get(CORE, 0)) for c in containers]
        return assignment_exists(self.free(), needs)

    def admit(
        self, containers: Sequence[tuple[Mapping[str, int], Sequence[str]]], *, init: int = 0
    ) -> Outcome:
        """Admit one pod: ``containers`` are (requests, resource order), the first
        ``init`` of them ordinary init containers. The pod spec reaches the book first,
        as the API server's watch would deliver it."""
        self.pods += 1
        name = f"p{self.pods}"
        specs = [
            ContainerSpec(f"c{i}", dict(requests), init=i < init)
            for i, (requests, _order) in enumerate(containers)
        ]
        self.api_pods[name] = pod_object(name, specs)
        if self.specs is not None:
            self.specs.update(self.api_pods[name])
        outcome = Outcome()
        could_fit = self.pod_fits([s for s in specs if not s.init]) and all(
            self.pod_fits([s]) for s in specs if s.init
        )
        for spec, (_requests, order) in zip(specs, containers, strict=True):
            try:
                record = self.kubelet.admit(
                    name, spec.name, spec.requests, order=order, init=spec.init
                )
            except AdmissionError as exc:
                if exc.reason == "OutOfResources":
                    outcome.insufficient += 1
                elif "no GPU memory limit" in str(exc):
                    assert not spec.requests.get(MEMORY), exc  # only ever a core-only one
                    outcome.core_only += 1
                else:
                    outcome.refused += 1
                    if could_fit:
                        outcome.needless += 1
                        outcome.details.append(f"{name}/{spec.name} {dict(spec.requests)}: {exc}")
                self.api_pods[name] = pod_object(name, specs, phase="Failed")
                if self.specs is not None:  # the watch reports the rejected pod as Failed
                    self.specs.update(self.api_pods[name])
                break
            cards = {d.split("::")[0] for ids in record.devices.values() for d in ids}
            visible = set(record.card().split(","))
            if len(cards) > 1 or record.conflicts or (cards and visible != cards):
                outcome.split += 1
                outcome.details.append(f"SPLIT {name}/{spec.name}: {record.devices}")
            else:
                outcome.admitted += 1
        else:
            # Admitted whole: the pod starts, and the watch reports it Running. Its spec
            # is still the fact about the container holding the last binding.
            self.api_pods[name] = pod_object(name, specs, phase="Running")
            if self.specs is not None:
                self.specs.update(self.api_pods[name])
        return outcome


def assignment_exists(
    free: Mapping[str, Sequence[int]], needs: Sequence[tuple[int, int]]
) -> bool:
    """Brute force: can each (memory, core) need go whole to one card of ``free``?"""
    for cards in itertools.product(list(free), repeat=len(needs)):
        left = {uuid: list(room) for uuid, room in free.items()}
        for uuid, (memory, core) in zip(cards, needs, strict=True):
            left[uuid][0] -= memory
            left[uuid][1] -= core
        if all(m >= 0 and c >= 0 for m, c in left.values()):
            return True
    return False


def pod_object(
    name: str, containers: Sequence[ContainerSpec], phase: str = "Pending"
) -> dict[str, Any]:
    def body(spec: ContainerSpec) -> dict[str, Any]:
        return {
            "name": spec.name,
            "resources": {"limits": {k: str(v) for k, v in spec.requests.items()}},
        }

    return {
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {
            "initContainers": [body(c) for c in containers if c.init],
            "containers": [body(c) for c in containers if not c.init],
        },
        "status": {"phase": phase},
    }


def elapsed(start: float) -> float:
    return time.perf_counter() - start
