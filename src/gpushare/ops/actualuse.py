"""What each container really uses, beside what it was allocated: Prometheus gauges read
at scrape time from HAMi-core's shared-region file in each container's cache directory
(:mod:`gpushare.host.sharedregion`; the file is the tenant's, so it feeds these gauges
and nothing else).

* ``gpushare_container_memory_used_bytes``: GPU memory the container's processes hold,
  as HAMi-core counts it (compare ``gpushare_container_memory_bytes``, the limit);
* ``gpushare_container_core_utilization_percent``: the SM utilisation HAMi-core recorded
  for them (compare ``gpushare_container_core_units``);
* ``gpushare_usage_reports_refused``: containers whose file failed a check at the last
  reading (a container that has not run a CUDA program yet has no file: not counted).

Reading every container's file costs CPU (and the interpreter lock) that Allocate needs:
a flood of scrapes used to re-read them all each time (32 scraping connections took the
median Allocate from 5.4 to 259 ms). The readings are therefore cached and re-read at
most every :data:`REFRESH_SECONDS`, by one scrape at a time; scrapes meanwhile are
answered from the cache (figures HAMi-core itself updates about once a second, scraped
every 15 to 60 s: nothing is lost to a reader).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from prometheus_client.core import GaugeMetricFamily, Metric

from gpushare.host.library import cache_key, cache_root
from gpushare.host.sharedregion import RegionError, RegionUsage, read_region
from gpushare.share.answers import CONTAINER_CACHE_FILE
from gpushare.share.devices import Resource
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder, UsageLedger

LABELS = ["namespace", "pod", "container", "gpu", "node"]
#: The file's name inside the container's cache directory.
REGION_FILE = CONTAINER_CACHE_FILE.rsplit("/", 1)[-1]
#: The files are read again at most this often (seconds), whatever the scrape rate.
REFRESH_SECONDS = 5.0

Readings = tuple[list[tuple["Holder", str, RegionUsage]], int]


def region_path(host_dir: Path, memory_device_ids: list[str]) -> Path:
    """Where the shared region of the container holding these memory units lies."""
    return cache_root(host_dir) / cache_key(memory_device_ids) / REGION_FILE


def _by_name(item: tuple[Holder, object]) -> tuple[str, str, str]:
    return item[0].namespace, item[0].pod, item[0].container


class ActualUseMetrics:
    """A collector: one region read per container holding memory units, at most every
    ``refresh_seconds`` (by one scrape; the others take the last readings)."""

    def __init__(
        self,
        host_dir: Path,
        records: Callable[[], Snapshot | None],
        usage: UsageLedger,
        node: str = "",
        refresh_seconds: float = REFRESH_SECONDS,
    ) -> None:
        self.host_dir = host_dir
        self.records = records
        self.usage = usage
        self.node = node
        self.refresh_seconds = refresh_seconds
        self._refreshing = threading.Lock()  # one reader of the files at a time
        self._cached: Readings | None = None
        self._read_at = float("-inf")

    def cached_readings(self) -> Readings:
        """The last readings, read again when older than ``refresh_seconds`` and no
        other scrape is reading them now (that one's are as good, and it is never
        waited for once there is something to answer)."""
        now = time.monotonic()
        if self._cached is not None and now - self._read_at < self.refresh_seconds:
            return self._cached
        if not self._refreshing.acquire(blocking=self._cached is None):
            return self._cached or ([], 0)
        try:
            if self._cached is None or time.monotonic() - self._read_at >= self.refresh_seconds:
                self._cached = self.readings()
                self._read_at = time.monotonic()
            return self._cached
        finally:
            self._refreshing.release()

    def readings(self) -> Readings:
        """(holder, card, usage) of every readable region, and how many were refused."""
        snapshot = self.records()
        if snapshot is None:
            return [], 0
        card_of = {
            holder: uuid for uuid, holders in self.usage.holders().items() for holder in holders
        }
        found: list[tuple[Holder, str, RegionUsage]] = []
        refused = 0
        for holder, by_resource in sorted(snapshot.devices.items(), key=_by_name):
            ids = by_resource.get(Resource.MEMORY)
            card = card_of.get(holder)
            if not ids or card is None:
                continue
            try:
                found.append((holder, card, read_region(region_path(self.host_dir, list(ids)))))
            except FileNotFoundError:
                continue
            except RegionError:
                refused += 1
        return found, refused

    def collect(self) -> Iterator[Metric]:
        memory = GaugeMetricFamily(
            "gpushare_container_memory_used_bytes",
            "GPU memory the container's processes hold, as HAMi-core counts it in the "
            "container's shared region (written by the tenant: a report, not a fact)",
            labels=LABELS,
        )
        util = GaugeMetricFamily(
            "gpushare_container_core_utilization_percent",
            "SM utilisation HAMi-core recorded for the container's processes (percent)",
            labels=LABELS,
        )
        readings, refused = self.cached_readings()
        for holder, card, use in readings:
            labels = [holder.namespace, holder.pod, holder.container, card, self.node]
            memory.add_metric(labels, use.memory_used_bytes)
            util.add_metric(labels, use.sm_utilization_percent)
        yield memory
        yield util
        rejected = GaugeMetricFamily(
            "gpushare_usage_reports_refused",
            "Containers whose shared-region file failed a check at the last reading",
            labels=["node"],
        )
        rejected.add_metric([self.node], refused)
        yield rejected
