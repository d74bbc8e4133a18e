"""What decides which backends a machine can measure: the card, the driver, cgroups,
MPS, the interposer and the memory hook.

The parsers are pure (recorded text in, plain data out; tested without a GPU);
:func:`gather` runs the read-only commands and reads the files they parse. Nothing here
changes anything: ``nvidia-smi`` is only queried, the MPS control executable only asked
for its help.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gpushare.base.kerneltables import named_numbers

#: The query ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits`` is run with.
SMI_FIELDS = (
    "index",
    "uuid",
    "name",
    "driver_version",
    "memory.total",
    "mig.mode.current",
    "persistence_mode",
    "compute_mode",
    "pci.bus_id",
)
#: The first driver with per-cgroup memory limits (NVIDIA r615, MPS v3).
DRIVER_LIMITS_MAJOR = 615
#: ``RmMemacctMode`` of the driver's registry keys: which memory-limit backend it loads.
MEMACCT_MODES = {"0": "off", "1": "misc", "2": "dmem", "3": "auto"}


@dataclass(frozen=True)
class Card:
    index: int
    uuid: str
    name: str
    driver: str
    memory_mib: int
    mig: str  # "Enabled", "Disabled" or "[N/A]"
    persistence: str
    compute_mode: str
    bus_id: str


@dataclass(frozen=True)
class Facts:
    """Everything the plan is decided on (all plain data, recorded in the results)."""

    cards: tuple[Card, ...] = ()
    smi_error: str = ""
    kernel: str = ""
    cgroup_fs: str = ""  # "cgroup2fs" where /sys/fs/cgroup is cgroup v2
    dmem_capacity: dict[str, int] = field(default_factory=dict)  # device -> bytes
    root_controllers: tuple[str, ...] = ()
    memacct_mode: str = ""  # from the driver's RegistryDwords, "" when not set
    mps_control: str = ""  # path of nvidia-cuda-mps-control, "" when absent
    mps_help: str = ""
    mps_v3_help: str = ""
    interposer: str = ""  # path of libvgpu.so where it is a file
    interposer_check: str = ""  # check-interposer.sh's line
    hook: str = ""  # path of the memory hook program where it is executable
    gcc: bool = False
    root: bool = False

    @property
    def card(self) -> Card | None:
        return self.cards[0] if self.cards else None

    @property
    def driver_major(self) -> int | None:
        return driver_major(self.card.driver) if self.card else None

    @property
    def mps_multi_user(self) -> bool:
        return bool({"-M", "--multiuser-server"} & set(self.mps_help.replace(",", " ").split()))

    @property
    def mps_namespaces(self) -> bool:
        return "namespace" in self.mps_v3_help

    @property
    def limits_backend(self) -> str:
        """Which of the driver's memory-limit backends this machine would use: ``dmem``
        (the kernel's cgroup controller lists the card), ``misc`` (the driver's own map),
        or "" where the driver has none (older than r615, or accounting off)."""
        major = self.driver_major
        if major is None or major < DRIVER_LIMITS_MAJOR or self.memacct_mode == "off":
            return ""
        if self.memacct_mode in ("dmem", "misc"):
            return self.memacct_mode
        return "dmem" if any(k.startswith("nvidia/") for k in self.dmem_capacity) else "misc"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(
            driver_major=self.driver_major,
            mps_multi_user=self.mps_multi_user,
            mps_namespaces=self.mps_namespaces,
            limits_backend=self.limits_backend,
        )
        return data


def driver_major(version: str) -> int | None:
    """``"580.159.04"`` -> 580; None for anything else."""
    match = re.match(r"\s*(\d+)\.", version)
    return int(match.group(1)) if match else None


def parse_smi(text: str) -> tuple[Card, ...]:
    """The cards from ``nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits``;
    lines that do not parse (a header, an error) are skipped."""
    cards = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(SMI_FIELDS) or not cells[0].isdigit():
            continue
        memory = re.match(r"\d+", cells[4])
        cards.append(
            Card(
                index=int(cells[0]),
                uuid=cells[1],
                name=cells[2],
                driver=cells[3],
                memory_mib=int(memory.group(0)) if memory else 0,
                mig=cells[5],
                persistence=cells[6],
                compute_mode=cells[7],
                bus_id=cells[8],
            )
        )
    return tuple(cards)


def parse_dmem_capacity(text: str) -> dict[str, int]:
    """``/sys/fs/cgroup/dmem.capacity``: ``<region> <bytes>`` per line (the driver's are
    ``nvidia/<pci-bdf>/vidmem``)."""
    return named_numbers(text)


def parse_cgroup_fs(mounts: str, mount_point: str = "/sys/fs/cgroup") -> str:
    """The file system type at ``mount_point`` from ``/proc/self/mounts``, in ``stat -f``'s
    words (``cgroup2fs``, ``tmpfs``); "" where nothing is mounted there."""
    kind = ""
    for line in mounts.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[1] == mount_point:
            kind = parts[2]  # the last mount at the point is the one seen
    return {"cgroup2": "cgroup2fs", "tmpfs": "tmpfs", "cgroup": "cgroupfs"}.get(kind, kind)


def parse_memacct_mode(params: str) -> str:
    """``RmMemacctMode`` from ``/proc/driver/nvidia/params``' ``RegistryDwords`` line
    (``RegistryDwords: "RmMemacctMode=2;..."``): off, misc, dmem, auto, or ""."""
    for line in params.splitlines():
        if line.split(":", 1)[0].strip() != "RegistryDwords":
            continue
        match = re.search(r"RmMemacctMode\s*=\s*(\w+)", line)
        if match:
            value = match.group(1)
            if value.lower().startswith("0x"):
                value = str(int(value, 16))
            return MEMACCT_MODES.get(value, f"unknown ({value})")
    return ""


# -- reading the machine (read-only) -----------------------------------------------------


def _run(args: list[str], timeout: float = 20.0) -> tuple[int, str]:
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 127, str(exc)
    return done.returncode, done.stdout + done.stderr


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""


def gather(
    interposer: str,
    hook: str,
    check_interposer: str = "scripts/check-interposer.sh",
    which: Callable[[str], str | None] = shutil.which,
) -> Facts:
    """Read this machine's facts (the commands are queries; nothing is changed)."""
    smi = which("nvidia-smi")
    cards: tuple[Card, ...] = ()
    smi_error = "no nvidia-smi on PATH"
    if smi:
        code, text = _run([smi, f"--query-gpu={','.join(SMI_FIELDS)}",
                           "--format=csv,noheader,nounits"])  # fmt: skip
        cards = parse_smi(text) if code == 0 else ()
        smi_error = "" if cards else f"nvidia-smi exit {code}: {text.strip()[:300]}"
    mps = which("nvidia-cuda-mps-control") or ""
    mps_help = mps_v3 = ""
    if mps:
        code, mps_help = _run([mps, "-h"])
        code3, mps_v3 = _run([mps, "-p", "3", "-h"])
        mps_v3 = mps_v3 if code3 == 0 else ""
    check = ""
    if Path(interposer).is_file() and Path(check_interposer).is_file() and which("nm"):
        lines = _run([check_interposer, interposer])[1].strip().splitlines()
        check = lines[-1] if lines else ""
    return Facts(
        cards=cards,
        smi_error=smi_error,
        kernel=platform.release(),
        cgroup_fs=parse_cgroup_fs(_read("/proc/self/mounts")),
        dmem_capacity=parse_dmem_capacity(_read("/sys/fs/cgroup/dmem.capacity")),
        root_controllers=tuple(_read("/sys/fs/cgroup/cgroup.controllers").split()),
        memacct_mode=parse_memacct_mode(_read("/proc/driver/nvidia/params")),
        mps_control=mps,
        mps_help=mps_help,
        mps_v3_help=mps_v3,
        interposer=interposer if Path(interposer).is_file() else "",
        interposer_check=check,
        hook=hook if os.access(hook, os.X_OK) else "",
        gcc=which("gcc") is not None,
        root=os.geteuid() == 0,
    )
