"""The simulated GPUs: a YAML node description, re-read when it changes.

Changing the file is how the tests, the demo and the benchmarks inject hardware events
(an XID, a card lost or back, a MIG layout changed); see :class:`SimulatedBackend`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpushare.base.dirwatch import DirWatch, StopEvent
from gpushare.gpu.gpus import Gpu, GpuError, GpuEvent, MigDevice, drifted
from gpushare.gpu.memlimits import SIM_MODES, LimitStore, MemoryLimits
from gpushare.gpu.migprofile import ProfileError, parse_profile
from gpushare.gpu.topology import Topology, from_description


@dataclass
class _SimulatedCard:
    gpu: Gpu
    xid: int | None = None
    instance_xids: dict[str, int] = field(default_factory=dict)  # MIG UUID -> XID


def _parse_instances(
    entry: dict[str, Any], where: str, parent: str, seen: set[str]
) -> tuple[tuple[MigDevice, ...], dict[str, int]]:
    """The ``instances`` of a simulated card in MIG mode, each checked like a card."""
    raw = entry.get("instances", [])
    if not isinstance(raw, list):
        raise GpuError(f"{where}: key 'instances' must be a list")
    if raw and not entry.get("mig"):
        raise GpuError(f"{where}: 'instances' need 'mig: true'")
    devices: list[MigDevice] = []
    xids: dict[str, int] = {}
    places: set[tuple[int, int]] = set()
    for position, item in enumerate(raw):
        at = f"{where}: instances[{position}]"
        if not isinstance(item, dict):
            raise GpuError(f"{at} must be a mapping")

        def need(key: str, default: Any = None, item: dict[str, Any] = item, at: str = at) -> int:
            value = item.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise GpuError(f"{at}: key {key!r} must be a non-negative integer, got {value!r}")
            return value

        uuid = item.get("uuid")
        if not isinstance(uuid, str) or not uuid.startswith("MIG-"):
            raise GpuError(f"{at}: key 'uuid' must be a string starting with MIG-, got {uuid!r}")
        if uuid in seen:
            raise GpuError(f"{at}: uuid {uuid} appears twice")
        seen.add(uuid)
        profile = item.get("profile")
        try:
            parse_profile(profile if isinstance(profile, str) else "")
        except ProfileError as exc:
            raise GpuError(f"{at}: key 'profile': {exc}") from None
        memory = need("memory_mib")
        if memory == 0:
            raise GpuError(f"{at}: key 'memory_mib' must be positive")
        gi, ci = need("gi"), need("ci", 0)
        if (gi, ci) in places:
            raise GpuError(f"{at}: gi {gi} / ci {ci} appears twice on this card")
        places.add((gi, ci))
        if item.get("xid") is not None:
            xids[uuid] = need("xid")
        devices.append(
            MigDevice(
                uuid=uuid,
                parent_uuid=parent,
                profile=str(profile),
                memory_mib=memory,
                gpu_instance=gi,
                compute_instance=ci,
                index=position,
                sm_count=need("sm", 0),
            )
        )
    return tuple(devices), xids


#: Keys a simulated node file may hold (top level, and per GPU entry). Anything else is
#: refused: a typo such as ``xids: 79`` would otherwise silently inject nothing.
SIMULATED_NODE_KEYS = frozenset(
    {"gpus", "topology", "cuda_driver_version", "driver_version", "nvml_store", "nvml_library"}
)
SIMULATED_GPU_KEYS = frozenset(
    {
        "uuid",
        "name",
        "memory_mib",
        "index",
        "minor",
        "numa_node",
        "xid",
        "mig",
        "mig_pending",
        "instances",
        "pci_bus_id",
        "compute_capability",
        "memory_limits",
        "reserved_mib",
        "persistence_mode",
    }
)


def _refuse_unknown(keys: Any, known: frozenset[str], where: str) -> None:
    unknown = sorted(str(key) for key in keys if key not in known)
    if unknown:
        raise GpuError(
            f"{where}: unknown key {unknown[0]!r}"[:300]
            + f"; known keys: {', '.join(sorted(known))}"
        )


def _parse_simulated_node(path: Path) -> list[_SimulatedCard]:
    """Read the YAML node description; every mistake names the entry and the key."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise GpuError(f"cannot read simulated node file {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise GpuError(f"simulated node file {path} is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list):
        raise GpuError(f"simulated node file {path} must hold a list under the key 'gpus'")
    _refuse_unknown(data, SIMULATED_NODE_KEYS, f"simulated node file {path}")
    cards: list[_SimulatedCard] = []
    seen: set[str] = set()
    for position, entry in enumerate(data["gpus"]):
        cards.append(_parse_card(entry, f"gpus[{position}] in {path}", position, seen))
    return cards


def _parse_card(entry: Any, where: str, position: int, seen: set[str]) -> _SimulatedCard:
    """One entry of ``gpus`` (at ``position``; ``seen``: the UUIDs read so far, its own
    and its MIG instances' added)."""
    if not isinstance(entry, dict):
        raise GpuError(f"{where} must be a mapping")
    _refuse_unknown(entry, SIMULATED_GPU_KEYS, where)

    def need(key: str, kind: type) -> Any:
        value = entry.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise GpuError(f"{where}: key {key!r} must be a {kind.__name__}, got {value!r}")
        return value

    uuid = need("uuid", str)
    if uuid in seen:
        raise GpuError(f"{where}: uuid {uuid} appears twice")
    seen.add(uuid)
    memory = need("memory_mib", int)
    if memory <= 0:
        raise GpuError(f"{where}: key 'memory_mib' must be positive, got {memory}")
    numa = entry.get("numa_node")
    if numa is not None and (not isinstance(numa, int) or isinstance(numa, bool)):
        raise GpuError(f"{where}: key 'numa_node' must be an integer, got {numa!r}")
    xid = entry.get("xid")
    if xid is not None and (not isinstance(xid, int) or isinstance(xid, bool)):
        raise GpuError(f"{where}: key 'xid' must be an integer, got {xid!r}")
    index = int(entry.get("index", position))
    instances, instance_xids = _parse_instances(entry, where, uuid, seen)
    limits_mode = entry.get("memory_limits", "ok")
    if limits_mode not in SIM_MODES:
        raise GpuError(f"{where}: key 'memory_limits' must be one of {', '.join(SIM_MODES)}")
    reserved, persistence = _driver_facts(entry, where, memory)
    capability = entry.get("compute_capability")
    if capability is not None:
        major, dot, minor = str(capability).partition(".")
        if not (major.isdigit() and dot and minor.isdigit()):
            raise GpuError(f"{where}: key 'compute_capability' must be like '8.0'")
    gpu = Gpu(
        uuid=uuid,
        name=str(entry.get("name", "Simulated GPU")),
        memory_mib=memory,
        index=index,
        minor=int(entry.get("minor", index)),
        numa_node=numa if numa is None or numa >= 0 else None,
        mig_enabled=bool(entry.get("mig", False)),
        pci_bus_id=str(entry.get("pci_bus_id", "")),
        mig_pending=bool(entry.get("mig_pending", False)),
        mig_devices=instances,
        compute_capability=(int(major), int(minor)) if capability is not None else None,
        reserved_mib=reserved,
        persistence_mode=persistence,
    )
    return _SimulatedCard(gpu, xid, instance_xids)


def _driver_facts(entry: dict[str, Any], where: str, memory: int) -> tuple[int, bool | None]:
    """What the driver says of a card beside its size: the memory it reserves for itself
    (``reserved_mib``, default 0: units are counted from what is left) and its
    persistence mode (``persistence_mode``; absent: unknown)."""
    reserved = entry.get("reserved_mib", 0)
    if not isinstance(reserved, int) or isinstance(reserved, bool) or not (0 <= reserved < memory):
        raise GpuError(
            f"{where}: key 'reserved_mib' must be an integer from 0 to below "
            f"memory_mib, got {reserved!r}"
        )
    persistence = entry.get("persistence_mode")
    if persistence is not None and not isinstance(persistence, bool):
        raise GpuError(f"{where}: key 'persistence_mode' must be true or false")
    return reserved, persistence


@dataclass
class SimulatedBackend:
    """GPUs described by a YAML file, re-read when it changes.

    Changing the file is how a test injects hardware events: an entry that gains
    ``xid: N`` delivers that XID once; an entry that disappears has fallen off the bus
    (and comes back when it reappears). The same holds for a MIG instance of a card
    (its XID names its GPU and compute instance); a card whose MIG mode or set of
    instances changes otherwise reports that its layout changed.
    """

    path: Path
    poll_seconds: float = 0.1
    _cards: dict[str, _SimulatedCard] = field(default_factory=dict, init=False)
    _stamp: tuple[int, int] = field(default=(0, 0), init=False)
    _served: dict[str, Gpu] = field(default_factory=dict, init=False)  # as last discovered

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self._load()
        self._publish_limits()

    # The driver's per-cgroup memory limits, simulated (gpu/memlimits.py) -------------
    def _publish_limits(self) -> None:
        """The store shared with the C stand-in NVML: the cards (with their
        ``memory_limits``: ok, broken, unsupported) and the driver version; only for a
        node file that names a driver version (nothing is written beside the others)."""
        if self.driver_version() is None:
            return
        modes = {}
        try:
            data = yaml.safe_load(self.path.read_text())
        except (OSError, yaml.YAMLError):
            data = None
        for entry in data.get("gpus", []) if isinstance(data, dict) else []:
            if isinstance(entry, dict) and isinstance(entry.get("uuid"), str):
                modes[entry["uuid"]] = str(entry.get("memory_limits", "ok"))
        totals = {card.gpu.uuid: card.gpu.memory_mib << 20 for card in self._cards.values()}
        try:
            self.limit_store.publish(self.driver_version() or "", modes, totals)
        except OSError as exc:
            raise GpuError(f"cannot write the simulated NVML store: {exc}") from None

    @property
    def limit_store(self) -> LimitStore:
        """``nvml_store`` of the node file (relative to it), default ``<file>.nvml``."""
        where = self._node_section("nvml_store")
        if isinstance(where, str) and where:
            return LimitStore(self.path.parent / where)
        return LimitStore(self.path.with_name(self.path.name + ".nvml"))

    def driver_version(self) -> str | None:
        """The file's ``driver_version: "615.20.01"``, if any (the NVIDIA driver)."""
        version = self._node_section("driver_version")
        return str(version) if version is not None else None

    def hook_extras(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """What the memory hook is given on this simulated node: the stand-in NVML
        (``nvml_library`` of the node file, relative to it) and its store (env)."""
        library = self._node_section("nvml_library")
        args = ("--nvml-lib", str(self.path.parent / library)) if library else ()
        return args, (f"GPUSHARE_NVML_STORE={self.limit_store.path}",)

    def set_memory_limits(self, uuid: str, namespace: str, soft: int, hard: int) -> None:
        self.limit_store.set_memory_limits(uuid, namespace, soft, hard)

    def get_memory_limits(self, uuid: str, namespace: str) -> MemoryLimits | None:
        return self.limit_store.get_memory_limits(uuid, namespace)

    def _file_stamp(self) -> tuple[int, int]:
        try:
            st = os.stat(self.path)
        except OSError:
            return (0, 0)
        return (st.st_mtime_ns, st.st_size)

    def _load(self) -> list[_SimulatedCard]:
        self._stamp = self._file_stamp()
        cards = _parse_simulated_node(self.path)
        self._cards = {card.gpu.uuid: card for card in cards}
        return cards

    def discover(self) -> list[Gpu]:
        gpus = [card.gpu for card in self._cards.values()]
        self._served = {gpu.uuid: gpu for gpu in gpus}
        return gpus

    def watch(self, deliver: Callable[[GpuEvent], None], stop: threading.Event) -> None:
        # Sleeps until the file's directory changes (inotify) when ``stop`` can wake it
        # (a StopEvent); else looks at the file every ``poll_seconds``.
        watcher = DirWatch(self.path.parent, self.poll_seconds)
        wakes = isinstance(stop, StopEvent)
        if isinstance(stop, StopEvent):
            stop.on_set(watcher.wake)
        try:
            while not stop.is_set():
                watcher.wait(None if wakes else self.poll_seconds)
                if not stop.is_set():
                    self._look(deliver)
        finally:
            if isinstance(stop, StopEvent):
                stop.remove(watcher.wake)
            watcher.close()

    def _look(self, deliver: Callable[[GpuEvent], None]) -> None:
        """Deliver what changed in the file since it was last read."""
        if self._file_stamp() == self._stamp:
            return
        before = self._cards
        try:
            self._load()
        except GpuError:
            return  # a half-written file; the next change re-reads it
        for uuid in before:
            if uuid not in self._cards:
                deliver(GpuEvent(uuid, gone=True))
        for uuid, card in self._cards.items():
            old = before.get(uuid)
            if old is None:
                deliver(GpuEvent(uuid, gone=False))
                known = self._served.get(uuid)
                if known is not None and drifted(known, card.gpu):  # back, repartitioned
                    deliver(GpuEvent(uuid, mig_changed=True))
            if card.xid is not None and (old is None or old.xid != card.xid):
                deliver(GpuEvent(uuid, xid=card.xid))
            if old is not None:
                self._look_mig(old, card, deliver)

    def _look_mig(
        self, old: _SimulatedCard, new: _SimulatedCard, deliver: Callable[[GpuEvent], None]
    ) -> None:
        known = self._served.get(new.gpu.uuid)
        if known is not None and drifted(known, new.gpu) and not drifted(known, old.gpu):
            deliver(GpuEvent(new.gpu.uuid, mig_changed=True))
        before = {device.uuid for device in old.gpu.mig_devices}
        now = {device.uuid: device for device in new.gpu.mig_devices}
        for uuid in before - now.keys():
            deliver(GpuEvent(uuid, gone=True))
        for uuid in now.keys() - before:
            deliver(GpuEvent(uuid, gone=False))
        for uuid, device in now.items():
            xid = new.instance_xids.get(uuid)
            if xid is not None and old.instance_xids.get(uuid) != xid:
                deliver(
                    GpuEvent(
                        new.gpu.uuid,
                        xid=xid,
                        gpu_instance=device.gpu_instance,
                        compute_instance=device.compute_instance,
                    )
                )

    def _node_section(self, key: str) -> Any:
        try:
            data = yaml.safe_load(self.path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise GpuError(f"cannot read {key} from {self.path}: {exc}") from None
        return data.get(key) if isinstance(data, dict) else None

    def topology(self) -> Topology:
        """The file's ``topology`` section (see :func:`gpushare.gpu.topology.from_description`)."""
        gpus = self.discover()
        by_key = {str(g.index): g.uuid for g in gpus} | {g.uuid: g.uuid for g in gpus}
        try:
            return from_description(
                self._node_section("topology"), by_key, {g.uuid: g.numa_node for g in gpus}
            )
        except ValueError as exc:
            raise GpuError(f"{self.path}: {exc}") from None

    def cuda_driver_version(self) -> tuple[int, int] | None:
        """The file's ``cuda_driver_version: "12.4"``, if any."""
        major, _, minor = str(self._node_section("cuda_driver_version") or "").partition(".")
        return (int(major), int(minor)) if major.isdigit() and minor.isdigit() else None

    def close(self) -> None:
        pass
