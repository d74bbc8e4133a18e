"""A refusal read from a pod spec hits only the pod whose Allocate it certainly is
(issue 41 item 10): the device-plugin API does not name the pod, so a tenant must not
deny its neighbours by creating a pod of their shape that earns a refusal."""

from __future__ import annotations

from typing import Any

from gpushare.kube.podspecs import PodSpecBook
from gpushare.kube.specrefusals import spec_refusal
from gpushare.share.devices import Resource
from gpushare.share.pairing import Basis, Decision
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder

PREFIX = "gpushare.io"
MEMORY, CORE, WHOLE = f"{PREFIX}/vcuda-memory", f"{PREFIX}/vcuda-core", f"{PREFIX}/gpu"
HOSTILE_ENV = [{"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "99999m"}]


def pod(name: str, limits: dict[str, int], **extra: Any) -> dict[str, Any]:
    container = {"name": "main", "resources": {"limits": {k: str(v) for k, v in limits.items()}}}
    return {
        "metadata": {"name": name, "namespace": "t", "uid": f"uid-{name}"},
        "spec": {"containers": [container | extra]},
        "status": {"phase": "Pending"},
    }


def book(*pods: dict[str, Any]) -> PodSpecBook:
    specs = PodSpecBook(PREFIX)
    for p in pods:
        specs.update(p)
    return specs


def refusal(specs: PodSpecBook, resource: Resource, size: int, records: Snapshot) -> str | None:
    return spec_refusal(specs, resource, size, records, Decision(None, Basis.FALLBACK), None)


def test_a_tamperer_beside_an_innocent_pod_of_its_shape_refuses_nobody() -> None:
    records = Snapshot(0.0)
    both = book(pod("hostile", {MEMORY: 4}, env=HOSTILE_ENV), pod("innocent", {MEMORY: 4}))
    assert refusal(both, Resource.MEMORY, 4, records) is None  # before: refused
    alone = book(pod("hostile", {MEMORY: 4}, env=HOSTILE_ENV))
    assert "hostile/main sets CUDA_DEVICE_MEMORY_LIMIT_0" in (
        refusal(alone, Resource.MEMORY, 4, records) or ""
    )


def test_cores_without_memory_beside_a_pod_asking_memory_refuses_nobody() -> None:
    records = Snapshot(0.0)
    both = book(pod("coreonly", {CORE: 30}), pod("honest", {CORE: 30, MEMORY: 4}))
    assert refusal(both, Resource.CORE, 30, records) is None
    alone = book(pod("coreonly", {CORE: 30}))
    assert "without" in (refusal(alone, Resource.CORE, 30, records) or "")


def test_a_mixer_refuses_only_the_request_it_waits_for() -> None:
    """A container holding a whole card (per the records) and asking 8 shared units is
    mid-admission only for a request of 8; records that still show it holding the card
    after its pod failed must not refuse a neighbour's request of another size."""
    mixer = Holder("t", "mixer", "main")
    records = Snapshot(0.0, exclusive={WHOLE: {"GPU-0": mixer}})
    specs = book(pod("mixer", {WHOLE: 1, MEMORY: 8}), pod("innocent", {MEMORY: 4}))
    assert refusal(specs, Resource.MEMORY, 4, records) is None  # before: refused as mixed
    assert "together with whole cards" in (refusal(specs, Resource.MEMORY, 8, records) or "")
