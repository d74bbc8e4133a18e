"""One shared-units Allocate, decided: what to refuse and what to grant. Pure.

:class:`~gpushare.deviceplugin.binding.Binder` gathers the facts of an Allocate (the
units asked, the card's health, the pairing decision, what the pod specs say) and
calls these functions, which touch no file, no lock and no clock: the refusals
(:func:`span_refusal`, :func:`partner_refusal`) and the plan (:func:`plan_share`:
the grant, its host side from :func:`gpushare.host.grants.share_needs`, the
container's edits from the answer port, and the name of the grant's CDI spec). Only
then does the binder apply it (``Binder._apply``: the host side made, the spec
written, the units recorded, the pairing told).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gpushare.host.grants import HostNeeds, NodeDirs, share_needs, with_dirs
from gpushare.host.grantspecs import grant_name
from gpushare.host.library import cache_key
from gpushare.share import answers
from gpushare.share.answers import ContainerEdits, DeviceListing, Enforcement
from gpushare.share.devices import Resource
from gpushare.share.pairing import Binding


@dataclass(frozen=True)
class SharePlan:
    """What one Allocate of shared units grants, before anything is made."""

    resource: Resource
    uuid: str  # the card
    numbers: tuple[int, ...]  # the units' numbers on the card
    device_ids: tuple[str, ...]
    grant: answers.Grant
    needs: HostNeeds  # the host side, made by the apply step
    edits: ContainerEdits  # the container's edits (before sealing)
    spec_name: str  # the grant's CDI spec, where the node's strategy seals answers


def span_refusal(
    resource: Resource,
    grouped: Mapping[str, Sequence[int]],
    asked: int,
    describe: Callable[[str], str],
) -> str | None:
    """Why units spread over several cards are refused (a container stays on one)."""
    if len(grouped) <= 1:
        return None
    cards = ", ".join(f"{describe(u)}: {len(n)} units" for u, n in grouped.items())
    return (
        f"a container must stay on one GPU, but its {resource.value} units span "
        f"{len(grouped)}: {cards}; no single card had {asked} free units"
    )


def partner_refusal(
    resource: Resource, uuid: str, partner: Binding | None, describe: Callable[[str], str]
) -> str | None:
    """Why units on card ``uuid`` are refused when the container's other resource was
    just bound to another card (``partner``); None when they may go there."""
    if partner is None or partner.card == uuid:
        return None
    return (
        f"this container's {partner.resource.value} units were just bound to "
        f"{describe(partner.card)}, but its {resource.value} units are on "
        f"{describe(uuid)}: no single card holds both requests"
    )


def plan_share(
    resource: Resource,
    uuid: str,
    numbers: Sequence[int],
    device_ids: Sequence[str],
    *,
    enforcement: Enforcement,
    unit_mib: int,
    dirs: NodeDirs,
    mps: bool,
    listing: DeviceListing | None,
    partner: Binding | None,
) -> SharePlan:
    """The grant of ``device_ids`` (units ``numbers`` of card ``uuid``) as one answer of
    ``resource``: its limit, its host side (``mps``: the node runs an MPS control
    daemon), and its edits (named as ``listing`` says)."""
    units = len(numbers)
    memory_mib = units * unit_mib if resource is Resource.MEMORY else None
    cores = units if resource is Resource.CORE else None
    # The host's names first (the cache directory's key, the grant's spec), then what
    # must exist there, then the container's edits that point at it.
    key, spec_name = cache_key(device_ids), grant_name(resource.value, device_ids)
    needs = share_needs(
        enforcement,
        uuid,
        dirs,
        key=key,
        memory_mib=memory_mib,
        cores=cores,
        mps=mps,
        units=device_ids,
        partner=partner.device_ids if partner is not None else None,
    )
    grant = with_dirs(
        answers.share(uuid, enforcement=enforcement, memory_mib=memory_mib, cores=cores), needs
    )
    return SharePlan(
        resource,
        uuid,
        tuple(numbers),
        tuple(device_ids),
        grant,
        needs,
        answers.container_edits(grant, listing),
        spec_name,
    )
