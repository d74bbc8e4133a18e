"""GPU discovery: one record per card, from NVML or from a simulated node description.

Both backends sit behind :class:`GpuBackend`, so the daemon, the demo and the tests
run the same code on a laptop as on a GPU node. Only this module imports ``pynvml``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog
import yaml

from gpushare.dirwatch import DirWatch, StopEvent

log = structlog.get_logger(__name__)

#: NVML XID events that the card itself reports; delivered to the health monitor.
XID_DEVICE_LOST = 79
#: How often the NVML backend reads every card to notice one lost or back.
PROBE_SECONDS = 5.0


class GpuError(Exception):
    """The GPUs cannot be read (driver missing, NVML failure, bad simulated node file)."""


@dataclass(frozen=True)
class Gpu:
    """What gpushare needs to know about one physical card."""

    uuid: str
    name: str
    memory_mib: int
    index: int
    minor: int
    numa_node: int | None = None
    mig_enabled: bool = False
    pci_bus_id: str = ""


@dataclass(frozen=True)
class GpuEvent:
    """Something NVML told us about one card: an XID error, or that it left or came back."""

    uuid: str
    xid: int | None = None  # None: the card disappeared (gone=True) or came back
    gone: bool = False


class GpuBackend(Protocol):
    """Where the GPUs come from."""

    def discover(self) -> list[Gpu]:
        """All cards on the node, MIG cards included (the caller skips those)."""
        ...

    def watch(self, deliver: Callable[[GpuEvent], None], stop: threading.Event) -> None:
        """Block until ``stop`` is set, calling ``deliver`` for every event seen."""
        ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- simulated


@dataclass
class _SimulatedCard:
    gpu: Gpu
    xid: int | None = None


#: Keys a simulated node file may hold (top level, and per GPU entry). Anything else is
#: refused: a typo such as ``xids: 79`` would otherwise silently inject nothing.
SIMULATED_NODE_KEYS = frozenset({"gpus"})
SIMULATED_GPU_KEYS = frozenset(
    {"uuid", "name", "memory_mib", "index", "minor", "numa_node", "xid", "mig", "pci_bus_id"}
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
        where = f"gpus[{position}] in {path}"
        if not isinstance(entry, dict):
            raise GpuError(f"{where} must be a mapping")
        _refuse_unknown(entry, SIMULATED_GPU_KEYS, where)

        def need(key: str, kind: type, entry: dict[str, Any] = entry, where: str = where) -> Any:
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
        gpu = Gpu(
            uuid=uuid,
            name=str(entry.get("name", "Simulated GPU")),
            memory_mib=memory,
            index=index,
            minor=int(entry.get("minor", index)),
            numa_node=numa if numa is None or numa >= 0 else None,
            mig_enabled=bool(entry.get("mig", False)),
            pci_bus_id=str(entry.get("pci_bus_id", "")),
        )
        cards.append(_SimulatedCard(gpu, xid))
    return cards


@dataclass
class SimulatedBackend:
    """GPUs described by a YAML file, re-read when it changes.

    Changing the file is how a test injects hardware events: an entry that gains
    ``xid: N`` delivers that XID once; an entry that disappears has fallen off the bus
    (and comes back when it reappears).
    """

    path: Path
    poll_seconds: float = 0.1
    _cards: dict[str, _SimulatedCard] = field(default_factory=dict, init=False)
    _stamp: tuple[int, int] = field(default=(0, 0), init=False)

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self._load()

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
        return [card.gpu for card in self._cards.values()]

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
            if card.xid is not None and (old is None or old.xid != card.xid):
                deliver(GpuEvent(uuid, xid=card.xid))

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- NVML


def _sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's ``00000000:3B:00.0`` as sysfs spells it: ``0000:3b:00.0``."""
    domain, _, rest = nvml_bus_id.partition(":")
    return f"{domain[-4:]}:{rest}".lower()


def _numa_node(bus_id: str, sysfs: Path = Path("/sys/bus/pci/devices")) -> int | None:
    try:
        value = int((sysfs / _sysfs_bus_id(bus_id) / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class NvmlBackend:
    """The real GPUs, read through NVML (``nvidia-ml-py``)."""

    def __init__(self) -> None:
        import pynvml

        self._nvml: Any = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise GpuError(
                f"cannot initialise NVML ({exc}); is the NVIDIA driver installed and is the "
                "container run with the NVIDIA runtime (NVIDIA_VISIBLE_DEVICES=all)?"
            ) from None
        self._handles: dict[str, Any] = {}

    def discover(self) -> list[Gpu]:
        """Every card NVML can read. A card that cannot be read is reported and left
        out (its size is unknown, so it cannot be advertised); only NVML failing as a
        whole, or every card failing, raises :class:`GpuError`."""
        nvml = self._nvml
        gpus: list[Gpu] = []
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as exc:
            raise GpuError(f"NVML failed while counting GPUs: {exc}") from None
        failures: list[str] = []
        for index in range(count):
            try:
                gpus.append(self._read_card(index))
            except nvml.NVMLError as exc:
                failures.append(f"GPU{index}: {exc}")
                log.error("gpu_unreadable", index=index, error=str(exc))
        if failures and not gpus:
            raise GpuError(f"NVML failed while listing GPUs: {'; '.join(failures)}")
        return gpus

    def _read_card(self, index: int) -> Gpu:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        bus_id = _text(nvml.nvmlDeviceGetPciInfo(handle).busId)
        try:
            mig_current, _pending = nvml.nvmlDeviceGetMigMode(handle)
            mig = bool(mig_current)
        except nvml.NVMLError:
            mig = False  # not supported on this card
        try:
            minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
        except nvml.NVMLError:
            minor = index
        gpu = Gpu(
            uuid=uuid,
            name=_text(nvml.nvmlDeviceGetName(handle)),
            memory_mib=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // (1 << 20),
            index=index,
            minor=minor,
            numa_node=_numa_node(bus_id),
            mig_enabled=mig,
            pci_bus_id=bus_id,
        )
        self._handles[uuid] = handle
        return gpu

    def watch(self, deliver: Callable[[GpuEvent], None], stop: threading.Event) -> None:
        nvml = self._nvml
        events = nvml.nvmlEventSetCreate()
        wanted = nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeDoubleBitEccError
        try:
            for uuid, handle in self._handles.items():
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, wanted, events)
                except nvml.NVMLError as exc:
                    log.warning("gpu_events_unsupported", gpu=uuid, error=str(exc))
            lost: set[str] = set()
            probed_at = time.monotonic()
            while not stop.is_set():
                if time.monotonic() - probed_at >= PROBE_SECONDS:
                    probed_at = time.monotonic()
                    self._probe(lost, deliver)
                try:
                    data = nvml.nvmlEventSetWait_v2(events, 500)
                except nvml.NVMLError_Timeout:
                    continue
                except nvml.NVMLError:
                    if stop.wait(1.0):
                        break
                    continue
                source = self._uuid_of(data.device)
                if source is None:
                    log.error("gpu_event_unattributed", event_type=int(data.eventType))
                    continue  # the next probe sees a card that stopped answering
                if data.eventType == nvml.nvmlEventTypeDoubleBitEccError:
                    deliver(GpuEvent(source, xid=48))  # XID 48: double-bit ECC error
                else:
                    deliver(GpuEvent(source, xid=int(data.eventData)))
        finally:
            nvml.nvmlEventSetFree(events)

    def _probe(self, lost: set[str], deliver: Callable[[GpuEvent], None]) -> None:
        """Read each card once: one that stops answering is gone, one that answers
        again is back (how a card that fell off the bus is seen again after a reset)."""
        nvml = self._nvml
        for uuid in list(self._handles):
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
                nvml.nvmlDeviceGetMemoryInfo(handle)
            except nvml.NVMLError as exc:
                if uuid not in lost:
                    lost.add(uuid)
                    log.error("gpu_lost", gpu=uuid, error=str(exc))
                    deliver(GpuEvent(uuid, gone=True))
                continue
            if uuid in lost:
                lost.discard(uuid)
                self._handles[uuid] = handle
                deliver(GpuEvent(uuid, gone=False))

    def _uuid_of(self, handle: Any) -> str | None:
        """The UUID of the card an event came from; None if no longer readable."""
        address = handle_address(handle)
        for uuid, known in self._handles.items():
            if address is not None and handle_address(known) == address:
                return uuid
        try:
            return _text(self._nvml.nvmlDeviceGetUUID(handle))
        except self._nvml.NVMLError:
            return None

    def close(self) -> None:
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


def handle_address(handle: Any) -> int | None:
    """The device an NVML handle points at. An event carries a new ctypes pointer
    object for the same device, and ctypes pointers compare by identity."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


def open_backend(simulate: str) -> GpuBackend:
    """The simulated backend when a node file is given, else NVML."""
    if simulate:
        return SimulatedBackend(Path(simulate))
    return NvmlBackend()
