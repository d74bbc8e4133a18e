"""The driver's per-cgroup GPU memory limits (NVIDIA r615+): NVML's
``nvmlDeviceSetMemoryLimits_v1`` / ``nvmlDeviceGetMemoryLimits_v1``, and the simulated
driver's store of them.

The NVML structures have no version field (x86-64: 24 and 32 bytes): ``nameSpace``
(the cgroup directory's full path), ``softLimit``, ``hardLimit`` (bytes) and, read only,
``currentUsed``; clearing is soft 0, hard ``UINT64_MAX``; a read of a cgroup without a
limit answers NOT_SUPPORTED. Taken from nvml.h of CUDA 13.4 as quoted by public projects
(see hook/memory-hook.c); to be confirmed on a GPU by ``make gpu-proof``.

:class:`LimitStore` is the simulated driver: a directory that the simulated backend
(:class:`gpushare.gpu.simulated.SimulatedBackend`) and the C stand-in NVML the memory hook
loads in the tests (``tests/kit/standin/libnvml_standin.c``) share, so a limit the hook sets
is the one the daemon reads back.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

#: ``hardLimit`` that clears a limit (with soft 0).
UNLIMITED = (1 << 64) - 1
#: NVML's return codes used here.
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_OPERATING_SYSTEM = 17
#: What a simulated card's ``memory_limits`` may say: ``ok``; ``broken`` (a set is
#: accepted and nothing kept: the read-back answers NOT_SUPPORTED); ``unsupported`` (a
#: set answers NOT_SUPPORTED); ``dmem`` (the kernel's dmem backend: a set needs every
#: level above the cgroup to enable ``+dmem``, else NOT_FOUND); ``gone`` (a set answers
#: OPERATING_SYSTEM, as for a cgroup the driver cannot open).
SIM_MODES = ("ok", "broken", "unsupported", "dmem", "gone")

#: What the NVML reference says each answer of the setter means, in the words the memory
#: hook (hook/memory-hook.c, ``explain``) prints too: the two must agree.
MEANINGS = {
    NVML_ERROR_INVALID_ARGUMENT: "a limit above the card's total memory, or soft above hard",
    NVML_ERROR_NO_PERMISSION: "setting a limit needs root with CAP_SYS_ADMIN",
    NVML_ERROR_NOT_FOUND: "the cgroup has no dmem files: a level above it does not enable +dmem",
    NVML_ERROR_OPERATING_SYSTEM: "the cgroup is gone or not visible to the driver",
}
#: A read-back answering NOT_SUPPORTED after a set that succeeded.
READBACK_UNSUPPORTED = "the limit is not enforced"


def explain(code: int) -> str:
    """What NVML's answer ``code`` to a memory-limit set means ("" for one not listed)."""
    return MEANINGS.get(code, "")


class MemoryLimitError(Exception):
    """An NVML memory-limit call failed; ``code`` is NVML's return code."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class MemoryLimits:
    soft: int
    hard: int
    used: int = 0


class MemoryLimitDriver(Protocol):
    """A backend that can set and read the driver's per-cgroup memory limits."""

    def driver_version(self) -> str | None: ...

    def set_memory_limits(self, uuid: str, namespace: str, soft: int, hard: int) -> None: ...

    def get_memory_limits(self, uuid: str, namespace: str) -> MemoryLimits | None:
        """The limit on ``namespace``; None where there is none (NOT_SUPPORTED)."""
        ...


def fnv1a64(text: str) -> int:
    """64-bit FNV-1a of the UTF-8 bytes (the store's file names; the C stand-in's too)."""
    value = 0xCBF29CE484222325
    for byte in text.encode():
        value = ((value ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return value


class LimitStore:
    """The simulated driver's limits: ``cards/<uuid>`` (one of :data:`SIM_MODES`),
    ``memory/<uuid>`` (the card's total, bytes), ``limits/<uuid>.<fnv1a64 hex>``
    ("<namespace>\\n<soft> <hard>\\n"), ``driver_version``.

    As the driver does: a set needs the namespace to be an existing directory
    (OPERATING_SYSTEM otherwise); soft 0 and hard :data:`UNLIMITED` clears; a hard limit
    above the card's total is INVALID_ARGUMENT; a read without a limit is None
    (NOT_SUPPORTED); a ``broken`` card accepts a set and keeps nothing, an ``unsupported``
    one refuses, a ``dmem`` one needs the ``+dmem`` chain (:func:`dmem_chain_broken`).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def publish(
        self, driver_version: str, cards: dict[str, str], totals: dict[str, int] | None = None
    ) -> None:
        """Write the cards (and their totals in bytes) and the driver version for the C
        stand-in to read."""
        (self.path / "cards").mkdir(parents=True, exist_ok=True)
        (self.path / "memory").mkdir(exist_ok=True)
        (self.path / "limits").mkdir(exist_ok=True)
        _write(self.path / "driver_version", driver_version + "\n")
        for folder, known in (("cards", cards), ("memory", totals or {})):
            for old in (self.path / folder).iterdir():
                if old.name not in known:
                    old.unlink(missing_ok=True)
        for uuid, mode in cards.items():
            _write(self.path / "cards" / uuid, mode + "\n")
        for uuid, total in (totals or {}).items():
            _write(self.path / "memory" / uuid, f"{total}\n")

    def total(self, uuid: str) -> int | None:
        """The card's total memory in bytes, where published."""
        try:
            return int((self.path / "memory" / uuid).read_text())
        except (OSError, ValueError):
            return None

    def _mode(self, uuid: str) -> str:
        if "/" in uuid or uuid in ("", ".", ".."):
            raise MemoryLimitError(f"no GPU {uuid!r}", NVML_ERROR_INVALID_ARGUMENT)
        try:
            return (self.path / "cards" / uuid).read_text().strip()
        except OSError:
            raise MemoryLimitError(f"no GPU {uuid}", 6) from None

    def _file(self, uuid: str, namespace: str) -> Path:
        return self.path / "limits" / f"{uuid}.{fnv1a64(namespace):016x}"

    def driver_version(self) -> str | None:
        try:
            return (self.path / "driver_version").read_text().strip() or None
        except OSError:
            return None

    def set_memory_limits(self, uuid: str, namespace: str, soft: int, hard: int) -> None:
        mode = self._mode(uuid)
        if mode == "gone" or not os.path.isdir(namespace):
            raise _refused(NVML_ERROR_OPERATING_SYSTEM, "Operating System Error", namespace)
        if mode == "unsupported":
            raise MemoryLimitError("Not Supported", NVML_ERROR_NOT_SUPPORTED)
        if mode == "dmem" and dmem_chain_broken(Path(namespace)):
            raise _refused(NVML_ERROR_NOT_FOUND, "Not Found", namespace)
        if mode == "broken":
            return
        target = self._file(uuid, namespace)
        if soft == 0 and hard == UNLIMITED:
            target.unlink(missing_ok=True)
            return
        total = self.total(uuid)
        if soft > hard or hard <= 0 or (total is not None and hard > total):
            raise _refused(NVML_ERROR_INVALID_ARGUMENT, "Invalid Argument", namespace)
        target.parent.mkdir(parents=True, exist_ok=True)
        _write(target, f"{namespace}\n{soft} {hard}\n")

    def get_memory_limits(self, uuid: str, namespace: str) -> MemoryLimits | None:
        self._mode(uuid)
        try:
            name, numbers = self._file(uuid, namespace).read_text().split("\n", 1)
        except (OSError, ValueError):
            return None
        if name != namespace:
            return None
        soft, hard = (int(n) for n in numbers.split())
        return MemoryLimits(soft, hard)

    def limits(self) -> dict[tuple[str, str], MemoryLimits]:
        """Every limit held: (card UUID, namespace) -> limits (for tests and inspect)."""
        found: dict[tuple[str, str], MemoryLimits] = {}
        folder = self.path / "limits"
        for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
            if entry.name.endswith(".tmp") or "." not in entry.name:
                continue
            name, numbers = entry.read_text().split("\n", 1)
            soft, hard = (int(n) for n in numbers.split())
            found[(entry.name.rsplit(".", 1)[0], name)] = MemoryLimits(soft, hard)
        return found


def _refused(code: int, name: str, namespace: str) -> MemoryLimitError:
    return MemoryLimitError(
        f"nvmlDeviceSetMemoryLimits_v1 for {namespace}: {name} ({code}): {explain(code)}", code
    )


def dmem_chain_broken(namespace: Path) -> bool:
    """Whether a level above ``namespace`` (its parent, up to the cgroup root: the last
    directory with ``cgroup.controllers`` whose parent has none) fails to enable ``dmem``
    in its ``cgroup.subtree_control``: then the kernel made no ``dmem.*`` files for it and
    the driver answers NOT_FOUND. The C stand-in reads the tree the same way."""
    level = namespace.parent
    while True:
        try:
            control = (level / "cgroup.subtree_control").read_text().split()
        except OSError:
            control = []
        if "dmem" not in control:
            return True
        root = (level / "cgroup.controllers").exists() and not (
            level.parent / "cgroup.controllers"
        ).exists()
        if root or level.parent == level:
            return False
        level = level.parent


def _write(target: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- NVML


class _SetLimits(ctypes.Structure):
    _fields_ = [
        ("nameSpace", ctypes.c_char_p),
        ("softLimit", ctypes.c_ulonglong),
        ("hardLimit", ctypes.c_ulonglong),
    ]


class _GetLimits(ctypes.Structure):
    _fields_ = [
        ("nameSpace", ctypes.c_char_p),
        ("softLimit", ctypes.c_ulonglong),
        ("hardLimit", ctypes.c_ulonglong),
        ("currentUsed", ctypes.c_ulonglong),
    ]


def _function(nvml: Any, name: str) -> Any:
    try:
        return nvml._nvmlGetFunctionPointer(name)
    except nvml.NVMLError as exc:
        raise MemoryLimitError(
            f"NVML has no {name} (driver r615 or newer is needed)", NVML_ERROR_FUNCTION_NOT_FOUND
        ) from exc


def nvml_set(nvml: Any, handle: Any, namespace: str, soft: int, hard: int) -> None:
    """``nvmlDeviceSetMemoryLimits_v1`` through ``pynvml``'s loaded library."""
    limits = _SetLimits(namespace.encode(), soft, hard)
    code = _function(nvml, "nvmlDeviceSetMemoryLimits_v1")(handle, ctypes.byref(limits))
    if code:
        meaning = explain(code)
        raise MemoryLimitError(
            f"nvmlDeviceSetMemoryLimits_v1 for {namespace}: {nvml.NVMLError(code)} ({code})"
            + (f": {meaning}" if meaning else ""),
            code,
        )


def nvml_get(nvml: Any, handle: Any, namespace: str) -> MemoryLimits | None:
    """``nvmlDeviceGetMemoryLimits_v1``; None for NOT_SUPPORTED (no limit there)."""
    limits = _GetLimits(namespace.encode(), 0, 0, 0)
    code = _function(nvml, "nvmlDeviceGetMemoryLimits_v1")(handle, ctypes.byref(limits))
    if code == NVML_ERROR_NOT_SUPPORTED:
        return None
    if code:
        raise MemoryLimitError(f"nvmlDeviceGetMemoryLimits_v1: {nvml.NVMLError(code)}", code)
    return MemoryLimits(limits.softLimit, limits.hardLimit, limits.currentUsed)
