"""What this node knows about its cards beyond the shared units, for the Node annotation,
the metrics and ``kubectl gpushare inspect``: who holds which whole card or MIG device,
each card's own health (not the offer board, which reads "unhealthy" while a card is held
whole), and the cards not offered as shared units at all (whole-only cards and cards in
MIG mode, with their MIG devices), so that every card the ``gpu.count`` label counts is
shown. A card offered as time-sliced replicas (card mode ``timeslice``) says how many
replicas it offers and who holds them.

Holders come from the kubelet's records (PodResources, the last read): the daemon's own
source of truth, never from anything a tenant writes. Cards in card mode ``dra`` carry
what the DRA driver has prepared on them, from the function it installs
(:meth:`CardFacts.serve_dra`; this layer does not know the driver).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from gpushare.gpu.gpus import Gpu
from gpushare.gpu.health import HealthBoard
from gpushare.gpu.mig import MigPlan
from gpushare.kube.nodestate import (
    CardEnforcement,
    CardExtras,
    DraClaimState,
    Hold,
    MigState,
    WholeCardState,
    with_dra_claims,
    with_replicas,
)
from gpushare.share.records import Snapshot


def mig_resource_names(plan: MigPlan, prefix: str) -> dict[str, str]:
    """MIG device UUID -> the full name of the resource it is served as."""
    return {d.uuid: f"{prefix}/{name}" for name, ds in plan.exclusive.items() for d in ds}


class CardFacts:
    """Reads, at call time, the boards and the last records into :class:`CardExtras`.

    ``cards``: the node's physical cards (what ``gpu.count`` counts); ``shared``: the
    UUIDs offered as shared units; ``mig_prefix``: the prefix MIG resources are named
    with (``nvidia.com`` with ``migNvidiaNames``)."""

    def __init__(
        self,
        cards: Sequence[Gpu],
        shared: Collection[str],
        plan: MigPlan,
        hardware: HealthBoard,
        mig_health: HealthBoard,
        records: Callable[[], Snapshot | None],
        mig_prefix: str,
        replicas: Mapping[str, str] | None = None,
        enforcement: tuple[CardEnforcement, ...] = (),
    ) -> None:
        self.cards = list(cards)
        self.shared = set(shared)
        self.plan = plan
        self.hardware = hardware
        self.mig_health = mig_health
        self.records = records
        self.mig_resources = mig_resource_names(plan, mig_prefix)
        self._parent = {d.uuid: d.parent_uuid for d in plan.mig_devices}
        #: time-sliced replicas: replica device ID -> its card; each card's count
        self._parent.update(replicas or {})
        self.replicas: dict[str, int] = {}
        for card in (replicas or {}).values():
            self.replicas[card] = self.replicas.get(card, 0) + 1
        #: card UUID -> the memory (MiB) and cores the DRA driver publishes of it
        self.dra_cards: dict[str, tuple[int, int]] = {}
        self.dra_claims: Callable[[], Mapping[str, Sequence[DraClaimState]]] | None = None
        #: each card's enforcement backends, decided at start (node/backendfacts.py)
        self.enforcement = enforcement

    def serve_dra(
        self,
        published: Mapping[str, tuple[int, int]],
        claims: Callable[[], Mapping[str, Sequence[DraClaimState]]],
    ) -> None:
        """The DRA driver serves the cards of ``published`` (card UUID -> the memory in
        MiB and the cores it offers of the card in all); ``claims`` answers, per card
        UUID, what it has prepared there. Called at every publication and scrape: it
        must be cheap (no file I/O, no lock held across the node)."""
        self.dra_cards = dict(published)
        self.dra_claims = claims

    def exclusive_resource_names(self) -> list[str]:
        """The MIG resources' full names (for the PodResources reader)."""
        return sorted(set(self.mig_resources.values()))

    def _healthy(self, uuid: str) -> bool:
        if uuid in self.mig_health.cards():
            return self.mig_health.is_healthy(uuid)
        return self.hardware.is_healthy(uuid)

    def holds(self) -> tuple[Hold, ...]:
        snapshot = self.records()
        if snapshot is None:
            return ()
        found = []
        for resource, devices in sorted(snapshot.exclusive.items()):
            for device, holder in sorted(devices.items()):
                found.append(
                    Hold(
                        resource,
                        device,
                        self._parent.get(device, device),
                        holder.namespace,
                        holder.pod,
                        holder.container,
                    )
                )
        return tuple(found)

    def extras(self) -> CardExtras:
        holds = self.holds()
        by_device = {h.device: h.holder for h in holds}
        served = self.plan.mig_of()
        dra = self.dra_claims() if self.dra_claims is not None else {}
        whole = []
        for gpu in sorted(self.cards, key=lambda g: g.index):
            if gpu.uuid in self.shared:
                continue
            mig = tuple(
                MigState(
                    uuid=d.uuid,
                    profile=d.profile,
                    resource=self.mig_resources[d.uuid],
                    healthy=self._healthy(d.uuid),
                    held_by=by_device.get(d.uuid, ""),
                )
                for d in served.get(gpu.uuid, ())
                if d.uuid in self.mig_resources
            )
            card = WholeCardState(
                uuid=gpu.uuid,
                index=gpu.index,
                name=gpu.name,
                memory_mib=gpu.memory_mib,
                healthy=self._healthy(gpu.uuid),
                held_by=by_device.get(gpu.uuid, ""),
                mig=mig,
            )
            if gpu.uuid in self.replicas:
                holders = sorted({h.holder for h in holds if h.card == gpu.uuid})
                card = with_replicas(card, self.replicas[gpu.uuid], holders)
            if gpu.uuid in self.dra_cards:
                published = self.dra_cards[gpu.uuid]
                card = with_dra_claims(card, tuple(dra.get(gpu.uuid, ())), published)
            whole.append(card)
        hardware = {uuid: self._healthy(uuid) for uuid in self.shared}
        return CardExtras(
            holds=holds, hardware_healthy=hardware, whole=tuple(whole), enforcement=self.enforcement
        )
