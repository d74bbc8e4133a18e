"""Is a file an ELF shared object for this machine? (The interposer must be one.)

A ``--library`` that is not (``/etc/passwd``, an x86-64 build on an arm64 node) is
installed, mounted and preloaded all the same, the dynamic loader skips it with a
warning inside each container, and the limits are silently not enforced. Only the
64-byte ELF header is read.
"""

from __future__ import annotations

import platform
import struct
from pathlib import Path

#: ``e_type`` of a shared object.
ET_DYN = 3
#: ``platform.machine()`` -> ELF ``e_machine``.
MACHINES = {
    "x86_64": 62,
    "amd64": 62,
    "aarch64": 183,
    "arm64": 183,
    "ppc64le": 21,
    "s390x": 22,
    "riscv64": 243,
}
MACHINE_NAMES = {62: "x86-64", 183: "aarch64", 21: "ppc64", 22: "s390x", 243: "riscv"}


class NotASharedObject(Exception):
    """The file is not an ELF shared object for this machine; the message says why."""


def check_shared_object(path: Path, machine: str | None = None) -> None:
    """Raise :class:`NotASharedObject` unless ``path`` starts with the ELF header of a
    64-bit shared object for ``machine`` (default: this one). OSError passes through."""
    with path.open("rb") as handle:
        header = handle.read(64)
    if len(header) < 20 or header[:4] != b"\x7fELF":
        raise NotASharedObject("not an ELF file")
    if header[4] != 2:
        raise NotASharedObject("not a 64-bit ELF file")
    order = "<" if header[5] == 1 else ">"
    e_type, e_machine = struct.unpack_from(order + "HH", header, 16)
    if e_type != ET_DYN:
        raise NotASharedObject(f"an ELF file of type {e_type}, not a shared object (3)")
    expected = MACHINES.get((machine or platform.machine()).lower())
    if expected is not None and e_machine != expected:
        found = MACHINE_NAMES.get(e_machine, f"machine {e_machine}")
        wanted = MACHINE_NAMES[expected]
        raise NotASharedObject(f"built for {found}, this node is {wanted}")


def stand_in(note: bytes = b"", machine: str | None = None) -> bytes:
    """The ELF header of a 64-bit little-endian shared object for ``machine`` (default:
    this one) followed by ``note``: what tests and the demo install instead of
    HAMi-core's library. It passes :func:`check_shared_object` and loads nowhere."""
    e_machine = MACHINES.get((machine or platform.machine()).lower(), 62)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = ident + struct.pack("<HHI", ET_DYN, e_machine, 1) + bytes(64 - 24)
    return header + note
