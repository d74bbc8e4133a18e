"""A fake NVML at the hardware edge: the ``pynvml`` functions the NVML backend calls,
answering from plain data (cards, MIG modes, MIG devices), so discovery runs without a
GPU. Profile IDs are the A100's as NVML reports them (``nvidia-smi mig -lgip``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

#: GPU-instance profile enum index -> the profile ID an A100 reports for it.
A100_GI_PROFILE_IDS = {0: 19, 1: 14, 2: 9, 3: 5, 4: 0, 7: 20, 9: 15}
#: Compute-instance profile enum index -> ID (the same on A100 and H100).
CI_PROFILE_IDS = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4}
GI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 7: 1, 9: 1}
CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}


@dataclass
class FakeMig:
    uuid: str
    gi: int
    ci: int
    gi_profile: int  # enum index
    ci_profile: int  # enum index
    memory_mib: int
    sm: int
    index: int = 0


@dataclass
class FakeCard:
    uuid: str
    name: str = "NVIDIA A100-SXM4-40GB"
    total_mib: int = 40536
    bus_id: str = "00000000:07:00.0"
    mig: tuple[int, int] = (0, 0)  # (current, pending)
    numa: int | None = None  # what nvmlDeviceGetNumaNodeId answers; None: not supported
    migs: list[FakeMig] = field(default_factory=list)
    max_mig: int = 7
    hide_instances: bool = False  # GI/CI lookups refused (fewer capabilities)
    #: what nvmlDeviceGetMemoryInfo version 2 says the driver reserves; None: the driver
    #: has only version 1 (a call with a version is refused)
    reserved_mib: int | None = None
    persistence: int | None = None  # nvmlDeviceGetPersistenceMode; None: not supported


class FakeNvml:
    def __init__(self, pynvml: Any, cards: list[FakeCard]) -> None:
        self.nvml = pynvml
        self.cards = cards

    def error(self, code: str) -> Exception:
        return self.nvml.NVMLError(getattr(self.nvml, code))  # type: ignore[no-any-return]

    def card(self, handle: Any) -> FakeCard:
        return self.cards[handle[1]]

    def mig(self, handle: Any) -> FakeMig:
        card = self.cards[handle[1]]
        for device in card.migs:
            if device.index == handle[2]:
                return device
        raise self.error("NVML_ERROR_NOT_FOUND")

    def uuid(self, handle: Any) -> str:
        return self.mig(handle).uuid if handle[0] == "mig" else self.card(handle).uuid

    def memory(self, handle: Any, version: int | None = None) -> Any:
        mib = self.mig(handle).memory_mib if handle[0] == "mig" else self.card(handle).total_mib
        if version is None:
            return SimpleNamespace(total=mib << 20)
        reserved = None if handle[0] == "mig" else self.card(handle).reserved_mib
        if reserved is None:
            raise self.error("NVML_ERROR_FUNCTION_NOT_FOUND")
        return SimpleNamespace(total=mib << 20, reserved=reserved << 20)

    def persistence_mode(self, handle: Any) -> int:
        mode = self.card(handle).persistence
        if mode is None:
            raise self.error("NVML_ERROR_NOT_SUPPORTED")
        return mode

    def by_uuid(self, uuid: str | bytes) -> Any:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for i, card in enumerate(self.cards):
            if card.uuid == text:
                return ("card", i)
            for device in card.migs:
                if device.uuid == text:
                    return ("mig", i, device.index)
        raise self.error("NVML_ERROR_NOT_FOUND")

    def numa(self, handle: Any) -> int:
        value = self.card(handle).numa
        if value is None:
            raise self.error("NVML_ERROR_NOT_SUPPORTED")
        return value

    def mig_handle(self, handle: Any, index: int) -> Any:
        card = self.card(handle)
        if not any(device.index == index for device in card.migs):
            raise self.error("NVML_ERROR_NOT_FOUND")
        return ("mig", handle[1], index)

    def attributes(self, handle: Any) -> Any:
        device = self.mig(handle)
        return SimpleNamespace(
            multiprocessorCount=device.sm,
            gpuInstanceSliceCount=GI_SLICES[device.gi_profile],
            computeInstanceSliceCount=CI_SLICES[device.ci_profile],
            memorySizeMB=device.memory_mib,
        )

    def gi_by_id(self, handle: Any, gi: int) -> Any:
        card = self.card(handle)
        if card.hide_instances:
            raise self.error("NVML_ERROR_NO_PERMISSION")
        for device in card.migs:
            if device.gi == gi:
                return ("gi", handle[1], gi, device)
        raise self.error("NVML_ERROR_NOT_FOUND")

    def ci_by_id(self, instance: Any, ci: int) -> Any:
        device = instance[3]
        if device.ci != ci:
            raise self.error("NVML_ERROR_NOT_FOUND")
        return ("ci", device)

    def gi_profile_info(self, handle: Any, index: int, version: int = 2) -> Any:
        if index not in A100_GI_PROFILE_IDS:
            raise self.error("NVML_ERROR_NOT_SUPPORTED")
        return SimpleNamespace(id=A100_GI_PROFILE_IDS[index])

    def ci_profile_info(self, instance: Any, index: int, engine: int, version: int = 2) -> Any:
        if index not in CI_PROFILE_IDS or engine != 0:
            raise self.error("NVML_ERROR_INVALID_ARGUMENT")
        return SimpleNamespace(id=CI_PROFILE_IDS[index])

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name, value in {
            "nvmlInit": lambda: None,
            "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: len(self.cards),
            "nvmlDeviceGetHandleByIndex": lambda i: ("card", i),
            "nvmlDeviceGetHandleByUUID": self.by_uuid,
            "nvmlDeviceGetUUID": self.uuid,
            "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=self.card(h).bus_id.encode()),
            "nvmlDeviceGetMigMode": lambda h: list(self.card(h).mig),
            "nvmlDeviceGetMinorNumber": lambda h: h[1],
            "nvmlDeviceGetName": lambda h: self.card(h).name.encode(),
            "nvmlDeviceGetMemoryInfo": self.memory,
            "nvmlDeviceGetPersistenceMode": self.persistence_mode,
            "nvmlDeviceGetNumaNodeId": self.numa,
            "nvmlDeviceGetMaxMigDeviceCount": lambda h: self.card(h).max_mig,
            "nvmlDeviceGetMigDeviceHandleByIndex": self.mig_handle,
            "nvmlDeviceGetAttributes": self.attributes,
            "nvmlDeviceGetGpuInstanceId": lambda h: self.mig(h).gi,
            "nvmlDeviceGetComputeInstanceId": lambda h: self.mig(h).ci,
            "nvmlDeviceGetGpuInstanceById": self.gi_by_id,
            "nvmlGpuInstanceGetInfo": lambda gi: SimpleNamespace(
                profileId=A100_GI_PROFILE_IDS[gi[3].gi_profile]
            ),
            "nvmlGpuInstanceGetComputeInstanceById": self.ci_by_id,
            "nvmlComputeInstanceGetInfo": lambda ci: SimpleNamespace(
                profileId=CI_PROFILE_IDS[ci[1].ci_profile]
            ),
            "nvmlDeviceGetGpuInstanceProfileInfo": self.gi_profile_info,
            "nvmlGpuInstanceGetComputeInstanceProfileInfo": self.ci_profile_info,
        }.items():
            monkeypatch.setattr(self.nvml, name, value)


def reference_layout(uuid: str = "GPU-7780f282-99a1-7024-f7a4-65a55230ed76") -> FakeCard:
    """The reference document's A100: ``-cgi 9,14,19,19`` then ``-cci``."""
    return FakeCard(
        uuid=uuid,
        mig=(1, 1),
        migs=[
            FakeMig("MIG-a", gi=2, ci=0, gi_profile=2, ci_profile=2, memory_mib=20096, sm=42,
                    index=0),
            FakeMig("MIG-b", gi=3, ci=0, gi_profile=1, ci_profile=1, memory_mib=9984, sm=28,
                    index=1),
            FakeMig("MIG-c", gi=9, ci=0, gi_profile=0, ci_profile=0, memory_mib=4864, sm=14,
                    index=2),
            FakeMig("MIG-d", gi=10, ci=0, gi_profile=0, ci_profile=0, memory_mib=4864, sm=14,
                    index=4),  # index 3 empty: skipped as not found
        ],
    )
