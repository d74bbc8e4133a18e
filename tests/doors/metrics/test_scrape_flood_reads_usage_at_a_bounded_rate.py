"""Issue 32.10: a flood of /metrics scrapes must not cost the admission path. Every
scrape used to re-read every container's HAMi-core file (32 scraping connections took
the median Allocate from 5.4 to 259 ms); the files are now read at most every
``REFRESH_SECONDS`` whatever the scrape rate, and at most two scrapes render at once.

The reads are counted by the kernel (inotify ``IN_OPEN`` on each container's cache
directory) while many connections scrape over HTTP; no timing is asserted."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import struct
import threading
import time
from pathlib import Path

from conftest import TESLA_P4, Node, cards
from kit.procs import eventually, free_port, scrape

from gpushare.host import sharedregion as region
from gpushare.ops.actualuse import REFRESH_SECONDS, REGION_FILE, region_path

IN_OPEN = 0x20
CONTAINERS = 4
SCRAPERS, SCRAPES_EACH = 8, 8  # 8: the metrics port admits 8 connections per address


class Opens:
    """Counts the opens of files in some directories (Linux inotify, through ctypes)."""

    def __init__(self, directories: list[Path]) -> None:
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.fd >= 0
        for directory in directories:
            assert self.libc.inotify_add_watch(self.fd, str(directory).encode(), IN_OPEN) >= 0

    def count(self, name: str) -> int:
        seen = 0
        while True:
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                return seen
            at = 0
            while at < len(data):
                _wd, mask, _cookie, size = struct.unpack_from("iIII", data, at)
                entry = data[at + 16 : at + 16 + size].rstrip(b"\0").decode()
                seen += bool(mask & IN_OPEN) and entry == name
                at += 16 + size

    def close(self) -> None:
        os.close(self.fd)


def test_a_scrape_flood_reads_each_container_file_at_a_bounded_rate(node: Node) -> None:
    port = free_port()
    node.start(cards(TESLA_P4, 1), metrics_port=port, metrics_address="127.0.0.1")
    host = Path(node.settings.host_lib_dir)
    files = []
    for n in range(CONTAINERS):
        admitted = node.kubelet.admit(f"p{n}", "main", {node.memory: 2})
        path = region_path(host, admitted.devices[node.memory])
        path.write_bytes(region.build_region([(10, 256 << 20, 5)], admitted.card(), 512 << 20, 0))
        files.append(path)
    opens = Opens([p.parent for p in files])

    def shown() -> bool:  # all four read once (a container's figures come within a period)
        return scrape(port)[1].count("gpushare_container_memory_used_bytes{") == CONTAINERS

    eventually(shown, 60.0)
    try:
        opens.count(REGION_FILE)  # the reads so far
        began = time.monotonic()
        failures: list[int] = []

        def scraper() -> None:
            done = 0
            while done < SCRAPES_EACH:
                status, text = scrape(port)
                if status == 503:
                    continue  # over the per-address connection cap (another bound): again
                done += 1
                if status != 200 or "gpushare_container_memory_used_bytes{" not in text:
                    failures.append(status)

        threads = [threading.Thread(target=scraper) for _ in range(SCRAPERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.monotonic() - began
        read = opens.count(REGION_FILE)
    finally:
        opens.close()
    assert failures == []  # every scrape answered, with the figures
    # each file read once per refresh period at most (plus the first), not once a scrape
    periods = 1 + math.ceil(elapsed / REFRESH_SECONDS)
    assert read <= CONTAINERS * periods < CONTAINERS * SCRAPERS * SCRAPES_EACH, (read, elapsed)
