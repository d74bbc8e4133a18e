"""The real GPUs, read through NVML (``nvidia-ml-py``): cards, their MIG devices and
profile names, XID events and lost cards, NVLink/NUMA/PCIe topology.

Loaded only when the node is not simulated (:func:`gpushare.node.discovery.open_backend`). A
card or MIG device that cannot be read is logged and left out, never fatal.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from gpushare.gpu.gpus import (
    NO_INSTANCE,
    PROBE_SECONDS,
    Gpu,
    GpuError,
    GpuEvent,
    MigDevice,
    drifted,
)
from gpushare.gpu.memlimits import MemoryLimitError, MemoryLimits, nvml_get, nvml_set
from gpushare.gpu.migprofile import (
    COMPUTE_INSTANCE_PROFILES,
    GPU_INSTANCE_PROFILES,
    MigProfile,
    ProfileError,
    memory_gb,
    profile_of,
)
from gpushare.gpu.pci import SYSFS_PCI_DEVICES, sysfs_bus_id
from gpushare.gpu.topology import Topology

log = structlog.get_logger(__name__)


def _numa_node(bus_id: str, sysfs: Path = SYSFS_PCI_DEVICES) -> int | None:
    try:
        value = int((sysfs / sysfs_bus_id(bus_id) / "numa_node").read_text().strip())
    except (OSError, ValueError):
        return None
    return value if value >= 0 else None


class NvmlBackend:
    """The real GPUs, read through NVML (``nvidia-ml-py``)."""

    def __init__(self, sysfs: Path = SYSFS_PCI_DEVICES) -> None:
        import pynvml

        self._sysfs = sysfs

        self._nvml: Any = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise GpuError(
                f"cannot initialise NVML ({exc}); is the NVIDIA driver installed and is the "
                "container run with the NVIDIA runtime (NVIDIA_VISIBLE_DEVICES=all)?"
            ) from None
        self._handles: dict[str, Any] = {}
        self._served: dict[str, Gpu] = {}
        #: what happens to the cards discovery reads (it fills the two maps it shares)
        self.events = NvmlEvents(pynvml, self._handles, self._served)

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
        uuid = text(nvml.nvmlDeviceGetUUID(handle))
        bus_id = text(nvml.nvmlDeviceGetPciInfo(handle).busId)
        current, pending = mig_mode(self._nvml, handle)
        try:
            minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
        except nvml.NVMLError:
            minor = index
        total, reserved = memory_info(nvml, handle, uuid)
        numa = _numa_node(bus_id, self._sysfs)
        if numa is None:  # sysfs does not show the card (a VM, a container without /sys)
            numa = self._nvml_numa_node(handle)
        try:
            cc_major, cc_minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            capability: tuple[int, int] | None = (int(cc_major), int(cc_minor))
        except nvml.NVMLError:
            capability = None
        gpu = Gpu(
            uuid=uuid,
            name=text(nvml.nvmlDeviceGetName(handle)),
            memory_mib=total // (1 << 20),
            index=index,
            minor=minor,
            numa_node=numa,
            mig_enabled=current,
            pci_bus_id=bus_id,
            mig_pending=current != pending,
            mig_devices=read_mig_devices(self._nvml, handle, uuid, total) if current else (),
            compute_capability=capability,
            reserved_mib=reserved // (1 << 20),
            persistence_mode=persistence_mode(nvml, handle),
        )
        self._handles[uuid] = handle
        self._served[uuid] = gpu
        return gpu

    def _nvml_numa_node(self, handle: Any) -> int | None:
        nvml = self._nvml
        try:
            value = int(nvml.nvmlDeviceGetNumaNodeId(handle))
        except (nvml.NVMLError, AttributeError):  # an old driver, or an old nvidia-ml-py
            return None
        return value if value >= 0 else None

    def watch(self, deliver: Callable[[GpuEvent], None], stop: threading.Event) -> None:
        self.events.watch(deliver, stop)

    def topology(self) -> Topology:
        """PCIe switches and NVLinks between the discovered cards. Untested without a
        GPU, so every NVML call is guarded: what cannot be read is left out (the
        preference then falls back to NUMA and positions)."""
        nvml = self._nvml
        cards = [(uuid, h) for uuid, h in self._handles.items()]
        bus_of: dict[str, str] = {}
        for uuid, handle in cards:
            with contextlib.suppress(nvml.NVMLError):
                bus_of[sysfs_bus_id(text(nvml.nvmlDeviceGetPciInfo(handle).busId))] = uuid
        switch: dict[str, str] = {}
        for (a, ha), (b, hb) in itertools.combinations(cards, 2):
            try:
                level = int(nvml.nvmlDeviceGetTopologyCommonAncestor(ha, hb))
            except nvml.NVMLError:
                continue
            if level <= nvml.NVML_TOPOLOGY_MULTIPLE:  # one board or PCIe switch tree
                group = switch.get(a) or switch.get(b) or a
                switch[a] = switch[b] = group
        nvlinks: dict[frozenset[str], int] = {}
        fabric: dict[str, int] = {}  # card -> its active links to an NVSwitch
        for uuid, handle in cards:
            for link in range(nvml.NVML_NVLINK_MAX_LINKS):
                try:
                    if nvml.nvmlDeviceGetNvLinkState(handle, link) != nvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
                except nvml.NVMLError:
                    break  # no more links on this card (or NVLink not supported)
                peer = bus_of.get(sysfs_bus_id(remote))
                if peer is None:
                    fabric[uuid] = fabric.get(uuid, 0) + 1  # an NVSwitch (or a bridge)
                elif peer != uuid:
                    key = frozenset((uuid, peer))
                    nvlinks[key] = nvlinks.get(key, 0) + 1
        nvlinks = {k: max(1, n // 2) for k, n in nvlinks.items()}  # each link seen from both ends
        for (a, na), (b, nb) in itertools.combinations(fabric.items(), 2):
            key = frozenset((a, b))
            nvlinks[key] = nvlinks.get(key, 0) + min(na, nb)
        numa = {uuid: _numa_node(bus) for bus, uuid in bus_of.items()}
        return Topology(nvlinks=nvlinks, numa=numa, switch=switch)

    def cuda_driver_version(self) -> tuple[int, int] | None:
        try:
            version = int(self._nvml.nvmlSystemGetCudaDriverVersion())  # e.g. 12040
        except self._nvml.NVMLError:
            return None
        return version // 1000, version % 1000 // 10

    # The driver's per-cgroup memory limits (r615+): gpu/memlimits.py -----------------
    def driver_version(self) -> str | None:
        try:
            return text(self._nvml.nvmlSystemGetDriverVersion())
        except self._nvml.NVMLError:
            return None

    def _handle_by_uuid(self, uuid: str) -> Any:
        try:
            return self._nvml.nvmlDeviceGetHandleByUUID(uuid.encode())
        except self._nvml.NVMLError as exc:
            raise MemoryLimitError(f"no GPU {uuid}: {exc}") from None

    def set_memory_limits(self, uuid: str, namespace: str, soft: int, hard: int) -> None:
        nvml_set(self._nvml, self._handle_by_uuid(uuid), namespace, soft, hard)

    def get_memory_limits(self, uuid: str, namespace: str) -> MemoryLimits | None:
        return nvml_get(self._nvml, self._handle_by_uuid(uuid), namespace)

    def close(self) -> None:
        with contextlib.suppress(self._nvml.NVMLError):
            self._nvml.nvmlShutdown()


class NvmlEvents:
    """What happens to the served cards, told as :class:`GpuEvent`: XIDs and double-bit
    ECC errors from NVML's event set, a card that stops answering (or answers again) at
    each probe, a MIG device lost or back, a MIG layout changed (reported once).
    ``handles`` and ``served`` are the backend's, filled by its discovery."""

    def __init__(self, nvml: Any, handles: dict[str, Any], served: dict[str, Gpu]) -> None:
        self._nvml = nvml
        self._handles = handles
        self._served = served
        self._drifted: set[str] = set()  # cards whose MIG layout changed (reported)
        self._lost_mig: set[str] = set()

    def watch(self, deliver: Callable[[GpuEvent], None], stop: threading.Event) -> None:
        nvml = self._nvml
        events = nvml.nvmlEventSetCreate()
        wanted = nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeDoubleBitEccError
        mig_change = int(getattr(nvml, "nvmlEventMigConfigChange", 0))
        try:
            for uuid, handle in self._handles.items():
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, wanted, events)
                except nvml.NVMLError as exc:
                    log.warning("gpu_events_unsupported", gpu=uuid, error=str(exc))
                if mig_change and self._served[uuid].mig_enabled:
                    with contextlib.suppress(nvml.NVMLError):
                        nvml.nvmlDeviceRegisterEvents(handle, mig_change, events)
            lost: set[str] = set()
            probed_at = time.monotonic()
            while not stop.is_set():
                if time.monotonic() - probed_at >= PROBE_SECONDS:
                    probed_at = time.monotonic()
                    self.probe(lost, deliver)
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
                served = self._served.get(source)
                if mig_change and data.eventType == mig_change:
                    if served is not None:
                        self._check_mig(source, self._handles[source], deliver)
                    continue
                gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
                if served is None or not served.mig_enabled:
                    gi = ci = NO_INSTANCE  # meaningless outside MIG mode
                xid = 48 if data.eventType == nvml.nvmlEventTypeDoubleBitEccError else None
                deliver(  # XID 48: double-bit ECC error
                    GpuEvent(
                        source,
                        xid=int(data.eventData) if xid is None else xid,
                        gpu_instance=None if gi == NO_INSTANCE else gi,
                        compute_instance=None if ci == NO_INSTANCE else ci,
                    )
                )
        finally:
            nvml.nvmlEventSetFree(events)

    def probe(self, lost: set[str], deliver: Callable[[GpuEvent], None]) -> None:
        """Read each card once: one that stops answering is gone, one that answers
        again is back (how a card that fell off the bus is seen again after a reset).
        A card that answers has its MIG mode and MIG devices read again."""
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
            self._check_mig(uuid, handle, deliver)

    def _check_mig(self, uuid: str, handle: Any, deliver: Callable[[GpuEvent], None]) -> None:
        """Compare a card's MIG mode and MIG devices with what is served: a MIG device
        missing is gone (and back when it reappears); another mode, or a MIG device not
        served, is a changed layout (reported once)."""
        nvml = self._nvml
        served = self._served[uuid]
        current, pending = mig_mode(self._nvml, handle)
        try:
            present = (
                {text(nvml.nvmlDeviceGetUUID(h)) for _i, h in mig_handles(self._nvml, handle)}
                if current
                else set()
            )
        except nvml.NVMLError:
            return  # read again at the next probe
        now = Gpu(
            uuid=uuid,
            name=served.name,
            memory_mib=served.memory_mib,
            index=served.index,
            minor=served.minor,
            mig_enabled=current,
            mig_pending=current != pending,
            mig_devices=tuple(MigDevice(m, uuid, "", 1, 0, 0) for m in sorted(present)),
        )
        if drifted(served, now) and uuid not in self._drifted:
            self._drifted.add(uuid)
            log.error(
                "gpu_mig_layout_changed",
                gpu=uuid,
                mig_enabled=current,
                mig_pending=current != pending,
                detail="restart gpushare to serve the new layout",
            )
            deliver(GpuEvent(uuid, mig_changed=True))
        for device in served.mig_devices:
            if device.uuid not in present and device.uuid not in self._lost_mig:
                self._lost_mig.add(device.uuid)
                log.error("mig_device_lost", gpu=uuid, mig=device.uuid)
                deliver(GpuEvent(device.uuid, gone=True))
            elif device.uuid in present and device.uuid in self._lost_mig:
                self._lost_mig.discard(device.uuid)
                deliver(GpuEvent(device.uuid, gone=False))

    def _uuid_of(self, handle: Any) -> str | None:
        """The UUID of the card an event came from; None if no longer readable."""
        address = handle_address(handle)
        for uuid, known in self._handles.items():
            if address is not None and handle_address(known) == address:
                return uuid
        try:
            return text(self._nvml.nvmlDeviceGetUUID(handle))
        except self._nvml.NVMLError:
            return None


def memory_info(nvml: Any, handle: Any, uuid: str) -> tuple[int, int]:
    """(total, reserved) bytes of a card: ``nvmlDeviceGetMemoryInfo`` version 2, whose
    ``reserved`` is what the driver keeps for itself (about 450 MiB on a T4); where the
    driver or nvidia-ml-py has only version 1, the reservation is taken as 0 (the shares
    are then counted from the nominal total, as before) and ``memory_reserved_unknown``
    says so."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            return int(info.total), int(info.reserved)
        except (nvml.NVMLError, TypeError, AttributeError):
            pass
    log.warning(
        "memory_reserved_unknown",
        gpu=uuid,
        detail="nvmlDeviceGetMemoryInfo version 2 not available: units are counted from "
        "the card's nominal total, which includes what the driver reserves",
    )
    return int(nvml.nvmlDeviceGetMemoryInfo(handle).total), 0


def persistence_mode(nvml: Any, handle: Any) -> bool | None:
    """The card's persistence mode (``nvmlDeviceGetPersistenceMode``); None: unknown."""
    try:
        return bool(int(nvml.nvmlDeviceGetPersistenceMode(handle)))
    except (nvml.NVMLError, AttributeError, TypeError, ValueError):
        return None


def handle_address(handle: Any) -> int | None:
    """The device an NVML handle points at. An event carries a new ctypes pointer
    object for the same device, and ctypes pointers compare by identity."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None


# --------------------------------------------------------------------------- MIG


def text(value: str | bytes) -> str:
    """NVML answers bytes with old bindings, str with new ones."""
    return value.decode() if isinstance(value, bytes) else value


def mig_mode(nvml: Any, handle: Any) -> tuple[bool, bool]:
    """(current, pending) MIG mode; both off where the card has no MIG."""
    try:
        current, pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:
        return False, False  # not supported on this card
    return bool(current), bool(pending)

def mig_handles(nvml: Any, parent: Any) -> list[tuple[int, Any]]:
    """(index, handle) of every MIG device of a card in MIG mode."""
    found = []
    for index in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(parent))):
        try:
            found.append((index, nvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, index)))
        except nvml.NVMLError_NotFound:
            continue
    return found

def read_mig_devices(nvml: Any, parent: Any, parent_uuid: str, total: int) -> tuple[MigDevice, ...]:
    """The card's MIG devices; one that cannot be read is logged and left out."""
    devices = []
    try:
        handles = mig_handles(nvml, parent)
    except nvml.NVMLError as exc:
        log.error("mig_devices_unreadable", gpu=parent_uuid, error=str(exc))
        return ()
    for index, handle in handles:
        try:
            attributes = nvml.nvmlDeviceGetAttributes(handle)
            gi = int(nvml.nvmlDeviceGetGpuInstanceId(handle))
            ci = int(nvml.nvmlDeviceGetComputeInstanceId(handle))
            devices.append(
                MigDevice(
                    uuid=text(nvml.nvmlDeviceGetUUID(handle)),
                    parent_uuid=parent_uuid,
                    profile=mig_profile(nvml, parent, attributes, gi, ci, total),
                    memory_mib=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // (1 << 20),
                    gpu_instance=gi,
                    compute_instance=ci,
                    index=index,
                    sm_count=int(attributes.multiprocessorCount),
                )
            )
        except (nvml.NVMLError, ProfileError) as exc:
            log.error("mig_device_unreadable", gpu=parent_uuid, index=index, error=str(exc))
    return tuple(devices)

def mig_profile(nvml: Any, parent: Any, attributes: Any, gi: int, ci: int, total: int) -> str:
    """The profile name, found as go-nvlib finds it: the GPU-instance and
    compute-instance profile enum indices whose profile IDs match the instances'.
    Where those cannot be read (they may need more capabilities than the MIG device
    itself), the slice counts of the device's attributes name it, without suffix."""
    memory = int(attributes.memorySizeMB)
    try:
        instance = nvml.nvmlDeviceGetGpuInstanceById(parent, gi)
        gi_profile = int(nvml.nvmlGpuInstanceGetInfo(instance).profileId)
        compute = nvml.nvmlGpuInstanceGetComputeInstanceById(instance, ci)
        ci_profile = int(nvml.nvmlComputeInstanceGetInfo(compute).profileId)
        for i in GPU_INSTANCE_PROFILES:
            try:
                if int(nvml.nvmlDeviceGetGpuInstanceProfileInfo(parent, i).id) != gi_profile:
                    continue
            except nvml.NVMLError:
                continue  # not supported on this card
            for j in COMPUTE_INSTANCE_PROFILES:
                try:
                    info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(instance, j, 0)
                except nvml.NVMLError:
                    continue
                if int(info.id) == ci_profile:
                    return str(profile_of(i, j, memory, total))
    except nvml.NVMLError as exc:
        log.warning("mig_profile_from_attributes", gi=gi, ci=ci, error=str(exc))
    return str(
        MigProfile(
            compute_slices=int(attributes.computeInstanceSliceCount),
            gpu_slices=int(attributes.gpuInstanceSliceCount),
            memory_gb=memory_gb(memory, total),
        )
    )
