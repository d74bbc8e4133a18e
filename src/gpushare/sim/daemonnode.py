"""One simulated GPU node with the real daemon: simulated cards, the kubelet stand-in,
and the daemon's binder behind real gRPC over unix sockets.

Used by the trace simulation (``make simulate``) as "the node": a pod sent there is
admitted the way the kubelet admits it (containers in order, resources in Go-map
order, GetPreferredAllocation then Allocate), and the daemon decides the cards. The
daemon is given the pods' specs, as its API-server watch would give them.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from gpushare.config import Settings
from gpushare.daemon import Daemon
from gpushare.extender.fit import CardRoom, PodNeed
from gpushare.host.elf import stand_in
from gpushare.kube.podspecs import PodSpecBook
from gpushare.sim.kubeletdouble import AdmissionError, ContainerSpec, SimulatedKubelet

#: A stand-in interposer file (an ELF header that loads nowhere): nothing is enforced
#: in a simulation.
_LIBRARY = stand_in(b"placeholder interposer for the simulation\n")

#: How long a node's daemon may take to register both resources (a loaded machine
#: starting a dozen daemons at once takes seconds).
REGISTER_WAIT = 60.0


class DaemonNode:
    """Start with :meth:`start`, stop with :meth:`stop` (removes its directory)."""

    def __init__(
        self, name: str, cards: Sequence[tuple[str, str, int]], placement: str, seed: int
    ) -> None:
        """``cards``: (UUID, model name, memory MiB) per card, in index order."""
        self.name = name
        self.cards = list(cards)
        self.root = Path(tempfile.mkdtemp(prefix="gs-sim-", dir="/tmp"))
        gpus = [
            {"uuid": uuid, "name": model, "memory_mib": mib, "numa_node": 0}
            for uuid, model, mib in self.cards
        ]
        (self.root / "node.yaml").write_text(yaml.safe_dump({"gpus": gpus}))
        (self.root / "libvgpu.so").write_bytes(_LIBRARY)
        self.settings = Settings(
            kubelet_dir=str(self.root / "dp"),
            pod_resources_socket=str(self.root / "pr" / "kubelet.sock"),
            simulate=str(self.root / "node.yaml"),
            library=str(self.root / "libvgpu.so"),
            host_lib_dir=str(self.root / "vgpu"),
            metrics_port=0,
            placement=placement,
        )
        self.kubelet = SimulatedKubelet(
            Path(self.settings.kubelet_dir), Path(self.settings.pod_resources_socket), seed=seed
        )
        self.specs = PodSpecBook(self.settings.resource_prefix)
        # The rig is the API server: every pod is in the book before the kubelet sees
        # it, so the daemon's fresh re-read of the pods on a miss (its pod watch's
        # ``refresh_now``) would find nothing new and "succeeds" at once. Without it a
        # Running holder's spec is unknown and the daemon pairs by the fallback, which
        # a real node never does (issue 32.18).
        self.specs.on_miss = lambda: True
        self.daemon: Daemon | None = None
        #: why each admission failed ("node/pod: reason"), in order
        self.failures: list[str] = []
        self.units = {uuid: mib // self.settings.memory_unit_mib for uuid, _m, mib in self.cards}

    def start(self) -> None:
        self.kubelet.start()
        kubelet = self.kubelet  # its version, as the Node would tell the daemon
        self.daemon = Daemon(
            self.settings, specs=self.specs, kubelet_version=lambda: kubelet.version
        )
        self.daemon.start()
        memory, core = self.settings.memory_resource, self.settings.core_resource

        def registered(kubelet: SimulatedKubelet) -> bool:
            return bool(kubelet.devices(memory)) and bool(kubelet.devices(core))

        if not self.kubelet.wait_for(registered, REGISTER_WAIT):
            raise RuntimeError(f"the daemon of {self.name} did not register")

    def stop(self) -> None:
        try:
            if self.daemon is not None:
                self.daemon.stop()
            self.kubelet.stop()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def _pod(self, name: str, need: PodNeed) -> dict[str, Any]:
        def spec(container: Any) -> dict[str, Any]:
            limits = {}
            if container.memory_units:
                limits[self.settings.memory_resource] = str(container.memory_units)
            if container.core_units:
                limits[self.settings.core_resource] = str(container.core_units)
            return {"name": container.name, "resources": {"limits": limits}}

        return {
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
            "spec": {
                "nodeName": self.name,
                "initContainers": [spec(c) for c in need.init_containers],
                "containers": [spec(c) for c in need.containers],
            },
            "status": {"phase": "Pending"},
        }

    def admit(self, name: str, need: PodNeed) -> dict[str, tuple[int, int]] | None:
        """Admit the pod; UUID -> (memory, core) units it took per card, or None if the
        kubelet failed it (an admission failure: UnexpectedAdmissionError)."""
        pod = self._pod(name, need)
        self.specs.update(pod)
        memory, core = self.settings.memory_resource, self.settings.core_resource

        def container(c: Any, init: bool) -> ContainerSpec:
            return ContainerSpec(c.name, {memory: c.memory_units, core: c.core_units}, init=init)

        specs = [container(c, True) for c in need.init_containers]
        specs += [container(c, False) for c in need.containers]
        try:
            admitted = self.kubelet.admit_pod(name, specs)
        except AdmissionError as exc:
            self.specs.remove(f"uid-{name}")
            self.failures.append(f"{self.name}/{name}: {exc}")
            return None
        pod["status"] = {"phase": "Running"}
        self.specs.update(pod)
        use: dict[str, tuple[int, int]] = {}
        for record in admitted:
            if record.init:
                continue
            card = record.card()
            held_memory, held_core = use.get(card, (0, 0))
            use[card] = (
                held_memory + len(record.devices.get(memory, ())),
                held_core + len(record.devices.get(core, ())),
            )
        return use

    def release(self, name: str) -> None:
        """The pod ended: its devices go back, as the kubelet frees them."""
        self.kubelet.release(name)
        self.specs.remove(f"uid-{name}")

    def rooms(self) -> list[CardRoom]:
        """Each card's free units, from the kubelet's allocations."""
        used: Mapping[str, list[int]] = {uuid: [0, 0] for uuid, _m, _mib in self.cards}
        memory = self.settings.memory_resource
        for record in list(self.kubelet.admitted.values()):
            for resource, ids in record.devices.items():
                for device in ids:
                    used[device.split("::")[0]][0 if resource == memory else 1] += 1
        return [
            CardRoom(uuid, index, self.units[uuid], self.units[uuid] - used[uuid][0],
                     100 - used[uuid][1])
            for index, (uuid, _m, _mib) in enumerate(self.cards)
        ]  # fmt: skip
