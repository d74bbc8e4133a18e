"""Publishing this node's pool as ResourceSlices, and checking what the server kept.

A thread keeps the node's slices equal to what it should publish: at start, on every
health change (:meth:`SlicePublisher.poke`) and every ``interval`` seconds (the kubelet
deletes a node's slices when it starts and 30 s after the last driver instance went
away: they are re-published on the next look). Each write bumps the pool's generation
in every slice; a slice holds at most 128 devices; each has the Node as owner.

**Read back.** An API server with ``DRAConsumableCapacity`` off stores a slice without
a word, minus ``allowMultipleAllocations`` and the capacities' request policies: every
claim would then get a whole card, the scheduler would hand each card to one claim and
nothing would say so. So before the first write a dry-run create shows what the server
would keep, and after every write the slices are read again. If the shared fields are
gone the shared devices are withdrawn (never served as exclusive by accident), one
``dra_consumable_capacity_off`` line says so and :meth:`SlicePublisher.problem` (the
part's readiness) says why. Likewise an unhealthy device is published with a
``NoSchedule`` taint; where the server drops device taints it leaves the slice instead.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from gpushare.dra.model import (
    API_VERSION,
    Offered,
    device_json,
    lost_in_storage,
    slices_json,
    taints_lost,
    unhealthy_reason,
)
from gpushare.gpu.health import HealthBoard
from gpushare.kube.stdlibclient import ApiClient, ApiStatusError

log = structlog.get_logger(__name__)

SLICES = f"/apis/{API_VERSION}/resourceslices"


def shape(devices: list[dict[str, Any]]) -> list[tuple[Any, bool, bool]]:
    """What of the devices the server keeps as written: names, sharing, taints (a slice
    edited by someone else, or stored by a server that drops fields, differs here)."""
    return [
        (d.get("name"), bool(d.get("allowMultipleAllocations")), bool(d.get("taints")))
        for d in devices
    ]


def content_digest(devices: list[dict[str, Any]]) -> str:
    """A digest of the devices as we write them (not as the server canonicalises them)."""
    text = json.dumps(devices, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


class SlicePublisher:
    """Keeps ``<node>``'s pool of ``driver`` in the API server."""

    def __init__(
        self,
        *,
        api: ApiClient,
        driver: str,
        node: str,
        devices: Callable[[], Sequence[Offered]],
        unit_mib: int,
        board: HealthBoard,
        interval: float = 10.0,
    ) -> None:
        self.api = api
        self.driver = driver
        self.node = node
        self.devices = devices
        self.unit_mib = unit_mib
        self.board = board
        self.interval = interval
        self.generation = 0
        self.capacity_off = ""  # what the server dropped, once seen
        self.taints_off = False
        self.published = False
        self.last_error = ""
        self.writes = 0  # slice writes made (creates and updates)
        self._probed = False
        self._owner: dict[str, Any] | None = None
        #: Each slice carries a digest of the devices written into it: a pass (this
        #: daemon's, a restarted one's or a second instance's in a rolling update) that
        #: finds the same content, names, count and one generation writes nothing, whatever
        #: canonical form the server gave the quantities.
        self._content_key = f"{driver}/devices-sha256"
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._forget: Callable[[], None] | None = None
        self._passes = 0
        self._pass_done = threading.Condition()

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        self._forget = self.board.listen(self.poke)
        self._thread = threading.Thread(target=self._run, name="dra-slices", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._forget is not None:
            self._forget()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def poke(self) -> None:
        """Look again now (a health change, a device change)."""
        self._wake.set()

    def wait_passes(self, count: int, timeout: float) -> bool:
        """Block until ``count`` more reconcile passes ran (for callers that need the
        slices current, e.g. tests and the bench)."""
        with self._pass_done:
            target = self._passes + count
            return self._pass_done.wait_for(lambda: self._passes >= target, timeout)

    def problem(self) -> str:
        """Why the pool is not (fully) served; "" when it is."""
        if self.capacity_off:
            return (
                "the API server drops consumable capacity (DRAConsumableCapacity off?): "
                f"{self.capacity_off}; shared devices are not published"
            )
        if not self.published:
            why = f": {self.last_error}" if self.last_error else ""
            return f"ResourceSlices not published yet{why}"
        return ""

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            try:
                self.reconcile()
                self.last_error = ""
            except (ApiStatusError, OSError, ValueError) as exc:
                if str(exc) != self.last_error:
                    log.warning("dra_slices_not_published", error=str(exc))
                self.last_error = str(exc)
            with self._pass_done:
                self._passes += 1
                self._pass_done.notify_all()
            self._wake.wait(self.interval)

    # ------------------------------------------------------------------ publishing
    def desired(self) -> list[dict[str, Any]]:
        """The devices to publish now, in slice order."""
        entries = []
        for device in self.devices():
            if device.shared and self.capacity_off:
                continue
            reason = unhealthy_reason(self.board, device)
            if reason is not None and self.taints_off:
                continue
            entries.append(device_json(device, self.unit_mib, self.driver, unhealthy=reason))
        return entries

    def _existing(self) -> dict[str, dict[str, Any]]:
        selector = f"spec.nodeName={self.node},spec.driver={self.driver}"
        found = self.api.get(SLICES, fieldSelector=selector)
        return {
            item["metadata"]["name"]: item
            for item in found.get("items") or []
            if (item.get("spec") or {}).get("driver") == self.driver
            and (item.get("spec") or {}).get("nodeName") == self.node
        }

    def _owner_reference(self) -> dict[str, Any] | None:
        if self._owner is None:
            try:
                node = self.api.get(f"/api/v1/nodes/{self.node}")
            except ApiStatusError as exc:
                log.warning("dra_node_unreadable", node=self.node, error=str(exc))
                return None
            self._owner = {
                "apiVersion": "v1",
                "kind": "Node",
                "name": self.node,
                "uid": node["metadata"]["uid"],
                "controller": True,
            }
        return self._owner

    def _probe(self, devices: list[dict[str, Any]]) -> None:
        """A dry-run create of one slice holding a shared device: what would be kept."""
        shared = [d for d in devices if d.get("allowMultipleAllocations")][:1]
        if not shared:
            return
        (probe,) = slices_json(self.node, self.driver, 1, shared, None)
        probe["metadata"]["name"] = f"{self.node}-{self.driver}-probe"[:253]
        stored = self.api.request("POST", SLICES, query={"dryRun": "All"}, body=probe)
        self._probed = True
        self._check_kept(shared, stored)

    def _check_kept(self, written: list[dict[str, Any]], stored: Any) -> None:
        kept = ((stored or {}).get("spec") or {}).get("devices") or []
        lost = lost_in_storage(written, kept)
        if lost and not self.capacity_off:
            self.capacity_off = "; ".join(lost)
            log.error(
                "dra_consumable_capacity_off",
                dropped=lost,
                detail="the API server keeps neither allowMultipleAllocations nor the "
                "capacities' request policies: turn DRAConsumableCapacity on in "
                "kube-apiserver, kube-scheduler and the kubelet (default from 1.36); "
                "the cards are not published for DRA until then",
            )
        if taints_lost(written, kept) and not self.taints_off:
            self.taints_off = True
            log.warning(
                "dra_device_taints_off",
                detail="the API server drops device taints (DRADeviceTaints off): "
                "unhealthy devices leave the slice instead",
            )

    def reconcile(self) -> bool:
        """One pass; True if slices were written."""
        devices = self.desired()
        if not self._probed:
            self._probe(devices)
            devices = self.desired()
        existing = self._existing()
        wanted = slices_json(self.node, self.driver, 0, devices, None)
        names = [s["metadata"]["name"] for s in wanted]
        pools = [(s.get("spec") or {}).get("pool") or {} for s in existing.values()]
        unchanged = (
            set(existing) == set(names)
            and len({p.get("generation") for p in pools}) == 1
            and all(p.get("resourceSliceCount") == len(names) for p in pools)
            and all(
                (existing[name]["metadata"].get("annotations") or {}).get(self._content_key)
                == content_digest(s["spec"]["devices"])
                and shape(existing[name]["spec"].get("devices") or [])
                == shape(s["spec"]["devices"])
                for name, s in zip(names, wanted, strict=True)
            )
        )
        if unchanged:
            # Adopted as ours: a later re-creation (the kubelet deletes the node's slices
            # as it starts) must carry a newer generation than these.
            self.generation = max(self.generation, int(pools[0].get("generation") or 0))
            self.published = True
            return False
        self._write(devices, existing)
        return True

    def _write(self, devices: list[dict[str, Any]], existing: dict[str, dict[str, Any]]) -> None:
        generations = [
            int(((s.get("spec") or {}).get("pool") or {}).get("generation") or 0)
            for s in existing.values()
        ]
        self.generation = max([self.generation, *generations]) + 1
        slices = slices_json(
            self.node, self.driver, self.generation, devices, self._owner_reference()
        )
        written: dict[str, list[dict[str, Any]]] = {}
        for piece in slices:
            name = piece["metadata"]["name"]
            digest = content_digest(piece["spec"]["devices"])
            piece["metadata"]["annotations"] = {self._content_key: digest}
            if name in existing:
                piece["metadata"]["resourceVersion"] = existing[name]["metadata"].get(
                    "resourceVersion"
                )
                self.api.request("PUT", f"{SLICES}/{name}", body=piece)
            else:
                self.api.request("POST", SLICES, body=piece)
            self.writes += 1
            written[name] = piece["spec"]["devices"]
        for name in sorted(set(existing) - set(written)):
            try:
                self.api.request("DELETE", f"{SLICES}/{name}")
            except ApiStatusError as exc:
                if exc.status != 404:
                    raise
        # Read back what the server kept.
        capacity_before, taints_before = self.capacity_off, self.taints_off
        for name, wrote in written.items():
            self._check_kept(wrote, self.api.get(f"{SLICES}/{name}"))
        log.info(
            "dra_slices_published",
            node=self.node,
            generation=self.generation,
            slices=len(slices),
            devices=len(devices),
        )
        if (self.capacity_off, self.taints_off) != (capacity_before, taints_before):
            self._write(self.desired(), self._existing())  # withdraw at once
            return
        self.published = True
