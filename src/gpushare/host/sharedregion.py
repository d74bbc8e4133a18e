"""HAMi-core's shared-region file, read for what each container really uses.

``libvgpu.so`` keeps its accounting in a file it ``mmap``s, named by
``CUDA_DEVICE_MEMORY_SHARED_CACHE``: for gpushare that is ``vgpu.cache`` in the
container's cache directory (``<host-lib-dir>/containers/<key>/``). The daemon reads it
for two figures only, exported beside the allocation: the GPU memory the container's
processes hold and the SM utilisation HAMi-core recorded for them.

**The file is written by the tenant.** Any process in the container can write any bytes
there, replace the file with a link, a FIFO or a huge sparse file, or keep changing it.
So it is read with bounded work (``O_NOFOLLOW``, a regular file only, a size window, at
most a header and ``proc_num`` slots read with ``pread``), every field read is checked
against its range, and the result is used for nothing but the two metrics: never for
placement, limits or health. A file that fails any check yields :class:`RegionError`
(counted, not exported). A torn read of a file being written is possible; the checks
make it harmless.

The layout (HAMi-core ``src/multiprocess/multiprocess_memory_limit.h``, shared-region
major version 1; 64-bit Linux, natural alignment, little-endian as on x86-64 and arm64):

* header: ``int32 initialized_flag`` (magic 19920718), ``uint32 major_version``,
  ``uint32 minor_version``, ``int32 sm_init_flag``, ``size_t owner_pid``, ``sem_t sem``
  (32 bytes), ``uint64 device_num``, ``char uuids[16][96]``, ``uint64 limit[16]``,
  ``uint64 sm_limit[16]``: 1856 bytes;
* ``procs[1024]``, each slot 1960 bytes: ``int32 pid``, ``int32 hostpid``,
  ``device_memory_t used[16]`` (``context_size, module_size, data_size, offset, total``
  and 3 unused ``uint64``), ``uint64 monitorused[16]``, ``device_util_t device_util[16]``
  (``dec_util, enc_util, sm_util`` and 3 unused ``uint64``), ``int32 status``, 4 bytes of
  padding, 3 ``uint64`` (a sequence lock and unused, by version);
* then ``int proc_num`` and a few more fields. The file is ``sizeof(shared_region_t)``
  long: a little over 2,008,900 bytes. Older layouts (no version fields, about 0.8 MB)
  and other majors are refused by the size window and the version check.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = 19920718
MAJOR_VERSION = 1
MAX_DEVICES = 16
MAX_PROCESSES = 1024
UUID_BYTES = 96

_HEADER = struct.Struct(f"<iIIiQ32sQ{MAX_DEVICES * UUID_BYTES}s{MAX_DEVICES}Q{MAX_DEVICES}Q")
_DEVICE_MEMORY = "8Q"  # context, module, data, offset, total, unused x3
_DEVICE_UTIL = "6Q"  # dec, enc, sm, unused x3
_SLOT = struct.Struct(
    "<ii" + _DEVICE_MEMORY * MAX_DEVICES + f"{MAX_DEVICES}Q" + _DEVICE_UTIL * MAX_DEVICES + "i4x3Q"
)
HEADER_SIZE = _HEADER.size  # 1856
SLOT_SIZE = _SLOT.size  # 1960
PROC_NUM_OFFSET = HEADER_SIZE + MAX_PROCESSES * SLOT_SIZE  # 2,008,896
#: The file must be at least this long (through proc_num and the three ints after it)...
MIN_FILE_SIZE = PROC_NUM_OFFSET + 16
#: ...and no longer than this (the known versions end within a few dozen bytes of it).
MAX_FILE_SIZE = MIN_FILE_SIZE + 4096

#: Slots read per ``pread``: a file claiming 1024 processes costs about 125 KB of buffer
#: at a time, not 2 MB (scrapes run in up to ``METRICS_LIMITS.max_connections`` threads).
SLOTS_PER_READ = 64

#: Bounds a field must keep: 1 PiB of GPU memory, a utilisation in percent.
MAX_BYTES = 1 << 50
MAX_PERCENT = 100

# Positions inside a slot's unpacked tuple.
_PID, _HOSTPID = 0, 1
_USED = 2  # used[d] starts at _USED + 8 * d; total is its 5th field
_MONITOR = _USED + 8 * MAX_DEVICES
_UTIL = _MONITOR + MAX_DEVICES  # device_util[d] starts at _UTIL + 6 * d; sm_util is 3rd


class RegionError(ValueError):
    """The file is not a shared region this reader can vouch for (one line)."""


@dataclass(frozen=True)
class RegionUsage:
    """What the region says of the container's first device (gpushare gives one)."""

    memory_used_bytes: int
    sm_utilization_percent: int
    processes: int


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise RegionError(what)


def parse_header(data: bytes) -> int:
    """Validate the header; return ``device_num``. RegionError for anything off."""
    _check(len(data) >= HEADER_SIZE, "shorter than the header")
    magic, major, minor, _sm_init, _owner, _sem, devices, uuids, *limits = _HEADER.unpack_from(
        data
    )
    _check(magic == MAGIC, "no shared-region magic (not initialised, or another format)")
    _check(major == MAJOR_VERSION, f"shared-region major version {major}, not {MAJOR_VERSION}")
    _check(minor < 1000, "implausible minor version")
    _check(0 <= devices <= MAX_DEVICES, "device count out of range")
    for d in range(devices):
        raw = uuids[d * UUID_BYTES : (d + 1) * UUID_BYTES]
        text, nul, _rest = raw.partition(b"\0")
        _check(bool(nul), f"uuid {d} is not NUL-terminated")
        _check(all(0x21 <= b <= 0x7E for b in text), f"uuid {d} is not printable ASCII")
        _check(limits[d] <= MAX_BYTES, f"memory limit {d} out of range")
        _check(limits[MAX_DEVICES + d] <= 1 << 32, f"SM limit {d} out of range")
    return int(devices)


def parse_proc_num(data: bytes) -> int:
    _check(len(data) >= 4, "no process count")
    (count,) = struct.unpack_from("<i", data)
    _check(0 <= count <= MAX_PROCESSES, "process count out of range")
    return int(count)


def parse_slots(data: bytes, count: int, device: int = 0) -> RegionUsage:
    """Sum device ``device`` over the ``count`` slots in ``data``."""
    _check(len(data) >= count * SLOT_SIZE, "shorter than its process slots")
    used = util = live = 0
    for i in range(count):
        slot = _SLOT.unpack_from(data, i * SLOT_SIZE)
        pid, hostpid = slot[_PID], slot[_HOSTPID]
        _check(pid >= 0 and hostpid >= 0, f"slot {i}: negative pid")
        if pid == 0:  # a free slot
            continue
        total = slot[_USED + 8 * device + 4]
        sm = slot[_UTIL + 6 * device + 2]
        _check(total <= MAX_BYTES, f"slot {i}: used memory out of range")
        _check(sm <= MAX_PERCENT, f"slot {i}: SM utilisation out of range")
        used += total
        util += sm
        live += 1
    _check(used <= MAX_BYTES, "used memory out of range")
    return RegionUsage(used, min(util, MAX_PERCENT), live)


def parse_region(data: bytes) -> RegionUsage:
    """The whole file's bytes -> usage (for tests and small files); RegionError if not."""
    _check(MIN_FILE_SIZE <= len(data) <= MAX_FILE_SIZE, "not the size of a shared region")
    devices = parse_header(data)
    count = parse_proc_num(data[PROC_NUM_OFFSET:])
    if devices == 0:
        return RegionUsage(0, 0, 0)
    return parse_slots(data[HEADER_SIZE:], count)


def _pread(fd: int, size: int, offset: int) -> bytes:
    data = os.pread(fd, size, offset)
    _check(len(data) == size, "changed size while read")
    return data


def read_region(path: Path) -> RegionUsage:
    """Read the region at ``path`` with bounded work: at most the header, four bytes
    and ``proc_num`` slots (about 2 MB at worst, a few KB for a container of a few
    processes), the slots :data:`SLOTS_PER_READ` at a time. Raises RegionError;
    FileNotFoundError when there is no file yet (the container has not started a CUDA
    program)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            raise FileNotFoundError(str(path)) from None
        raise RegionError(f"cannot open: {exc.strerror}") from None
    try:
        info = os.fstat(fd)
        _check(stat.S_ISREG(info.st_mode), "not a regular file")
        _check(MIN_FILE_SIZE <= info.st_size <= MAX_FILE_SIZE, "not the size of a shared region")
        try:
            devices = parse_header(_pread(fd, HEADER_SIZE, 0))
            count = parse_proc_num(_pread(fd, 4, PROC_NUM_OFFSET))
            if devices == 0:
                return RegionUsage(0, 0, 0)
            used = util = live = 0
            for first in range(0, count, SLOTS_PER_READ):
                n = min(SLOTS_PER_READ, count - first)
                part = parse_slots(_pread(fd, n * SLOT_SIZE, HEADER_SIZE + first * SLOT_SIZE), n)
                used += part.memory_used_bytes
                util += part.sm_utilization_percent
                live += part.processes
            _check(used <= MAX_BYTES, "used memory out of range")
            return RegionUsage(used, min(util, MAX_PERCENT), live)
        except OSError as exc:
            raise RegionError(f"cannot read: {exc.strerror}") from None
    finally:
        os.close(fd)


# -- writing one, as HAMi-core would (the simulated node and the tests) ------------------


def build_region(
    processes: list[tuple[int, int, int]],
    uuid: str = "",
    limit_bytes: int = 0,
    sm_limit: int = 0,
) -> bytes:
    """A shared region as HAMi-core lays it out, with one device and ``processes`` as
    (pid, used bytes, SM utilisation percent)."""
    header = _HEADER.pack(
        MAGIC,
        MAJOR_VERSION,
        2,
        1,
        0,
        b"",
        1,
        uuid.encode().ljust(MAX_DEVICES * UUID_BYTES, b"\0"),
        *([limit_bytes] + [0] * (MAX_DEVICES - 1)),
        *([sm_limit] + [0] * (MAX_DEVICES - 1)),
    )
    slots = bytearray(MAX_PROCESSES * SLOT_SIZE)
    for i, (pid, used, sm) in enumerate(processes):
        fields = [0] * (2 + 8 * MAX_DEVICES + MAX_DEVICES + 6 * MAX_DEVICES + 1 + 3)
        fields[_PID], fields[_HOSTPID] = pid, pid + 1000
        fields[_USED + 4] = used
        fields[_UTIL + 2] = sm
        _SLOT.pack_into(slots, i * SLOT_SIZE, *fields)
    tail = struct.pack("<iiiiQ32s", len(processes), 0, 0, 0, 0, b"")
    return header + bytes(slots) + tail
