"""What containers really use, from HAMi-core's shared-region file.

The file is the tenant's: the reader must survive any content (random and hostile
bytes, links, FIFOs, huge files) with bounded work, validate every field it reads, and
feed nothing but the two metrics. The layout facts are checked against a C declaration
of the structure compiled by gcc (offsets and size as the compiler lays them out).
"""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import TESLA_P4, Node, cards
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from kit.procs import daemon_samples, free_port
from kit.sizes import at_two_sizes
from test_node_api import eventually

from gpushare.host import sharedregion as region
from gpushare.ops.actualuse import region_path

VALID = region.build_region([(7, 3 << 30, 35), (8, 1 << 30, 20)], "GPU-1234", 8 << 30, 30)

# A C declaration written from the header's facts, to let the compiler lay it out.
C_LAYOUT = r"""
#include <semaphore.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
typedef struct { uint64_t context_size, module_size, data_size, offset, total, unused[3]; } mem_t;
typedef struct { uint64_t dec_util, enc_util, sm_util, unused[3]; } util_t;
typedef struct {
    int32_t pid; int32_t hostpid; mem_t used[16]; uint64_t monitorused[16];
    util_t device_util[16]; int32_t status; uint64_t seqlock; uint64_t unused[2];
} slot_t;
typedef struct {
    int32_t initialized_flag; uint32_t major_version; uint32_t minor_version;
    int32_t sm_init_flag; size_t owner_pid; sem_t sem; uint64_t device_num;
    char uuids[16][96]; uint64_t limit[16]; uint64_t sm_limit[16]; slot_t procs[1024];
    int proc_num; int utilization_switch; int recent_kernel; int priority;
    uint64_t last_kernel_time; sem_t sem_postinit;
} region_t;
int main(void) {
    printf("%zu %zu %zu %zu %zu %zu\n", offsetof(region_t, procs), sizeof(slot_t),
           offsetof(region_t, proc_num), sizeof(region_t), offsetof(region_t, device_num),
           offsetof(slot_t, device_util));
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_the_layout_matches_what_the_compiler_lays_out(tmp_path: Path) -> None:
    source = tmp_path / "layout.c"
    source.write_text(C_LAYOUT)
    subprocess.run(["gcc", "-o", str(tmp_path / "layout"), str(source)], check=True, timeout=60)
    out = subprocess.run([str(tmp_path / "layout")], capture_output=True, text=True, check=True)
    procs, slot, proc_num, size, device_num, util = map(int, out.stdout.split())
    assert (procs, slot, proc_num) == (region.HEADER_SIZE, region.SLOT_SIZE, region.PROC_NUM_OFFSET)
    assert device_num == 56 and util == 8 + 16 * 64 + 16 * 8
    assert region.MIN_FILE_SIZE <= size <= region.MAX_FILE_SIZE
    assert len(VALID) == size


def test_a_region_as_hami_core_writes_it_reads_back() -> None:
    use = region.parse_region(VALID)
    assert use == region.RegionUsage(4 << 30, 55, 2)
    empty = region.build_region([])
    assert region.parse_region(empty) == region.RegionUsage(0, 0, 0)


def _at(data: bytes, offset: int, fmt: str, value: Any) -> bytes:
    out = bytearray(data)
    struct.pack_into("<" + fmt, out, offset, value)
    return bytes(out)


SLOT0 = region.HEADER_SIZE
TOTAL0 = SLOT0 + 8 + 4 * 8  # used[0].total of slot 0
SM0 = SLOT0 + 8 + 16 * 64 + 16 * 8 + 2 * 8  # device_util[0].sm_util of slot 0


@pytest.mark.parametrize(
    "data,why",
    [
        (b"", "size"),
        (VALID[:-100], "size"),
        (VALID + b"\0" * 5000, "size"),
        (_at(VALID, 0, "i", 0), "magic"),
        (_at(VALID, 4, "I", 2), "major version"),
        (_at(VALID, 56, "Q", 17), "device count"),
        (_at(VALID, 64, "96s", b"G" * 96), "NUL"),
        (_at(VALID, 64, "3s", b"\x01\x02\x03"), "printable"),
        (_at(VALID, region.PROC_NUM_OFFSET, "i", -1), "process count"),
        (_at(VALID, region.PROC_NUM_OFFSET, "i", 1025), "process count"),
        (_at(VALID, SLOT0, "i", -5), "negative pid"),
        (_at(VALID, TOTAL0, "Q", 1 << 60), "used memory"),
        (_at(VALID, SM0, "Q", 101), "SM utilisation"),
        (_at(VALID, 1600, "Q", 1 << 63), "memory limit"),
    ],
)
def test_every_field_is_checked(data: bytes, why: str) -> None:
    with pytest.raises(region.RegionError, match=why):
        region.parse_region(data)


def test_free_slots_are_skipped_and_utilisation_is_capped() -> None:
    data = region.build_region([(0, 1 << 40, 100), (3, 1 << 20, 80), (4, 1 << 20, 90)])
    assert region.parse_region(data) == region.RegionUsage(2 << 20, 100, 2)


@at_two_sizes(
    given(st.binary(max_size=4096), st.integers(0, 2), st.booleans()),
    quick=80,
    full=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
def test_random_bytes_are_refused_or_read_within_bounds(
    noise: bytes, placement: int, pad: bool
) -> None:
    """Random bytes, alone, over the header or over the slots of a valid region."""
    if placement == 0:
        data = noise + (b"\0" * (region.MIN_FILE_SIZE - len(noise)) if pad else b"")
    else:
        at = 0 if placement == 1 else region.HEADER_SIZE
        data = VALID[:at] + noise + VALID[at + len(noise) :]
    _read_or_refuse(data)


@at_two_sizes(
    given(st.lists(st.tuples(st.integers(0, len(VALID) - 8), st.binary(min_size=1, max_size=8)))),
    quick=80,
    full=300,
    deadline=None,
)
def test_hostile_patches_of_a_valid_region(patches: list[tuple[int, bytes]]) -> None:
    data = bytearray(VALID)
    for offset, chunk in patches:
        data[offset : offset + len(chunk)] = chunk
    _read_or_refuse(bytes(data))


@at_two_sizes(
    given(
        st.integers(0, region.MAX_PROCESSES + 1),
        st.lists(st.integers(0, 1 << 64 - 1), min_size=1, max_size=4),
    ),
    quick=60,
    full=200,
    deadline=None,
)
def test_hostile_counts_and_values(count: int, values: list[int]) -> None:
    data = _at(VALID, region.PROC_NUM_OFFSET, "i", count)
    for i, value in enumerate(values):
        data = _at(data, TOTAL0 + i * region.SLOT_SIZE, "Q", value)
    _read_or_refuse(data)


def _read_or_refuse(data: bytes) -> None:
    try:
        use = region.parse_region(data)
    except region.RegionError as exc:
        assert "\n" not in str(exc) and len(str(exc)) < 200
        return
    assert 0 <= use.memory_used_bytes <= region.MAX_BYTES
    assert 0 <= use.sm_utilization_percent <= region.MAX_PERCENT
    assert 0 <= use.processes <= region.MAX_PROCESSES


# -- the file on disk: what a tenant can put there --------------------------------------


def test_read_region_reads_a_valid_file(tmp_path: Path) -> None:
    path = tmp_path / "vgpu.cache"
    path.write_bytes(VALID)
    assert region.read_region(path) == region.parse_region(VALID)


def test_no_file_yet_is_not_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        region.read_region(tmp_path / "vgpu.cache")


def test_links_fifos_directories_and_huge_files_are_refused_without_waiting(
    tmp_path: Path,
) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(VALID)
    link = tmp_path / "link"
    link.symlink_to(secret)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    directory = tmp_path / "dir"
    directory.mkdir()
    huge = tmp_path / "huge"
    with open(huge, "wb") as handle:
        handle.truncate(1 << 40)  # sparse: a terabyte that costs nothing to make
    for path, why in ((link, "cannot open"), (fifo, "regular"), (directory, "regular"),
                      (huge, "size")):  # fmt: skip
        done = threading.Event()
        errors: list[str] = []

        def attempt(
            p: Path = path, errors: list[str] = errors, done: threading.Event = done
        ) -> None:
            try:
                region.read_region(p)
            except region.RegionError as exc:
                errors.append(str(exc))
            done.set()

        threading.Thread(target=attempt, daemon=True).start()
        assert done.wait(30), f"{path.name}: the read blocked"
        assert errors and why in errors[0], (path.name, errors)


# -- over sockets: the daemon exports what the region says, beside the allocation ---------


def test_the_daemon_exports_used_memory_and_utilisation_per_container(node: Node) -> None:
    node.start(cards(TESLA_P4, 2), metrics_port=free_port(), metrics_address="127.0.0.1")
    a = node.kubelet.admit("a", "main", {node.memory: 8, node.core: 30})
    b = node.kubelet.admit("b", "main", {node.memory: 4})
    c = node.kubelet.admit("c", "main", {node.memory: 2})
    host = Path(node.settings.host_lib_dir)
    region_path(host, a.devices[node.memory]).write_bytes(
        region.build_region([(10, 1536 << 20, 25)], a.card(), 2048 << 20, 30)
    )
    region_path(host, b.devices[node.memory]).write_bytes(os.urandom(region.MIN_FILE_SIZE))
    # c has not started a CUDA program: no file, no figure, no refusal

    def exported() -> bool:
        return bool(daemon_samples(node, "gpushare_container_memory_used_bytes"))

    eventually(exported)
    used = daemon_samples(node, "gpushare_container_memory_used_bytes")
    assert [(s["pod"], s["gpu"], s["value"]) for s in used] == [("a", a.card(), 1536 << 20)]
    util = daemon_samples(node, "gpushare_container_core_utilization_percent")
    assert [(s["pod"], s["value"]) for s in util] == [("a", 25.0)]
    (refused,) = daemon_samples(node, "gpushare_usage_reports_refused")
    assert refused["value"] == 1
    limits = {s["pod"]: s["value"] for s in daemon_samples(node, "gpushare_container_memory_bytes")}
    assert limits["a"] == 8 * 256 << 20 and c.card()  # the allocation beside the use


def test_a_file_claiming_every_slot_is_read_a_little_at_a_time(tmp_path: Path) -> None:
    """Scrapes run in up to 32 threads: a tenant's file claiming 1024 processes must not
    make each of them hold its 2 MB of slots at once."""
    import tracemalloc

    full = region.build_region([(i + 1, 1 << 20, 0) for i in range(region.MAX_PROCESSES)])
    path = tmp_path / "vgpu.cache"
    path.write_bytes(full)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        usage = region.read_region(path)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert usage == region.parse_region(full)
    assert usage.processes == region.MAX_PROCESSES
    assert peak < 8 * region.SLOTS_PER_READ * region.SLOT_SIZE, f"peak {peak} bytes"
