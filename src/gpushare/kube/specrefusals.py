"""What the asking container's own pod spec makes a shared-units Allocate refuse.

Three refusals, each read from the pod specs of the node (``kube/podspecs.py``) and
the kubelet's records, before anything is granted: a container asking shared units
beside whole cards or MIG devices (its answers would name different GPUs), cores
without memory units (it would run with no memory limit on a shared card), and a spec
that sets what carries its limits (``share/reserved.py``). :func:`spec_refusal` says
why, or None; the device plugin's ``Binder._plan`` refuses with it. Pure over the
pod-spec book and plain data (the pairing decision, the records' snapshot), so it
stands beside the book it reads rather than in the door that asks.

The device-plugin API does not name the pod being admitted, so each refusal speaks only
when the Allocate is certainly that pod's (issue 41 item 10): a container the fresh
records show mid-admission (it holds one kind and waits for this request, of this size),
or a request whose every candidate (the pending pods of its shape the records leave)
would be refused. Otherwise it is admitted: a tenant creating a pod of its neighbour's
shape must not deny the neighbour, and under a CDI strategy the grant's spec replaces
what the tenant's spec set.
"""

from __future__ import annotations

import structlog

from gpushare.kube.podspecs import PodSpecBook, asking_tampering
from gpushare.share.devices import Resource
from gpushare.share.pairing import Binding, Decision
from gpushare.share.records import Snapshot
from gpushare.share.reserved import refusal as reserved_refusal
from gpushare.share.usage import Holder

log = structlog.get_logger(__name__)


def mixed_kinds(holder: Holder) -> str:
    """The refusal of a container that asks for shared units and whole cards or MIG."""
    return (
        f"container {holder.container} of pod {holder.namespace}/{holder.pod} asks for "
        "shared units (vcuda-memory/vcuda-core) together with whole cards or MIG devices; "
        "the answers would name different GPUs: split it into two containers"
    )


def core_without_memory(holder: Holder, prefix: str) -> str:
    """The refusal of a container that asks for cores and no memory units."""
    return (
        f"container {holder.container} of pod {holder.namespace}/{holder.pod} asks for "
        f"{Resource.CORE.name_with(prefix)} without {Resource.MEMORY.name_with(prefix)} "
        "(or with 0) and would run with no GPU memory limit on a shared card: add "
        f"{Resource.MEMORY.name_with(prefix)} of 1 or more to its limits"
    )


def spec_refusal(
    specs: PodSpecBook,
    resource: Resource,
    size: int,
    snapshot: Snapshot | None,
    decision: Decision,
    seen: Binding | None,
) -> str | None:
    """Why the container now asking for ``size`` units of ``resource`` is refused by
    what its pod spec says (``seen``: the binding made before this decision), or None."""
    if snapshot is not None:
        mixer = specs.mixer_being_admitted(snapshot, shared=resource)
        # mid-admission for this request only if it waits for this many units: records
        # still showing a failed mixer's whole card must not refuse a neighbour
        if mixer is not None and (specs.requests_of(mixer) or {}).get(resource) == size:
            return mixed_kinds(mixer)
    if decision.partner is not None:
        return None  # the second half of a container whose first half was checked
    holder = decision.holder
    if holder is None and snapshot is not None and seen is not None:
        holder = snapshot.holder_of(seen.resource, seen.device_ids[0])
    if resource is Resource.CORE:
        # Not the second half of a memory binding: a container of its own. If its
        # spec asks no memory units, it would run with the whole card's memory.
        asker = specs.asking_without_memory(size, snapshot, holder)
        if asker is not None:
            return core_without_memory(asker, specs.prefix)
    return _tampering(specs, resource, size, snapshot, holder)


def _tampering(
    specs: PodSpecBook,
    resource: Resource,
    size: int,
    snapshot: Snapshot | None,
    holder: Holder | None,
) -> str | None:
    """Why the container now asking is refused if its own spec sets what carries its
    limits (``share/reserved.py``). The admission policy refuses such a pod; this is the
    second line where the policy is off (docs/security.md)."""
    tamperer = asking_tampering(specs, resource, size, snapshot, holder)
    if tamperer is None:
        return None
    who, why = tamperer
    log.warning("reserved_settings_refused", holder=str(who), reason=why)
    return reserved_refusal(f"{who.pod}/{who.container}", why)
