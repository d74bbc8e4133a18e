"""Is this request the second half of the container bound last? A pure state machine.

The kubelet allocates a container's resources back to back, one Allocate per resource,
in no fixed order, and never says which container is asking. A container that asks
for both ``vcuda-memory`` and ``vcuda-core`` must get both on ONE card: if the second
resource landed elsewhere, the two answers would name two cards and the kubelet would
keep one of them, so one tenant's limits would be enforced on another tenant's card.

:class:`Pairing` remembers the last binding and :func:`decide`, for each new request, tells from
facts whether the request is that binding's partner (it must go to the same card) or
not (it may go anywhere):

* **Records.** The kubelet's PodResources ``List``, read AFTER the request arrived
  (the kubelet records each resource of the admitting container as soon as its
  Allocate returns, before it asks for the next one), names the container holding the
  last binding. If that container holds this resource too, it is complete: no partner.
* **Spec.** Otherwise the pod spec of that container says whether it wants this
  resource: yes, with this size: partner; no: not a partner.
* **Released.** The records no longer list the last binding (the kubelet rejected
  that pod) and no ordinary init container on record (those are never listed) could
  be asking: not a partner.
* **Fallback.** Records missing (no socket, refused, late), the holder not listed
  while an init container could be asking, its spec unknown, or the facts
  contradicting each other: the request is steered to the card of the last binding of the other
  resource made within :data:`PAIR_WINDOW`, and refused in Allocate if it lands
  elsewhere. This can refuse a container that would have fit, never split one.

The module does no I/O and reads no clock of its own: the binder passes the facts and
the time. See docs/placement.md.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpushare.share.devices import Resource
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder

#: The kubelet asks for a container's two resources within microseconds of each other;
#: a binding older than this is nobody's partner, whatever the facts.
PAIR_WINDOW = 10.0


@dataclass(frozen=True)
class Binding:
    """Units of one resource bound to one card by an Allocate that succeeded."""

    resource: Resource
    card: str
    device_ids: tuple[str, ...]
    at: float


class Basis(enum.Enum):
    """Why a decision was taken; the value reads as a log field."""

    NOTHING_TO_PAIR = "no recent binding of the other resource"
    EXPIRED = "no facts, and the last binding of the other resource is older than the window"
    COMPLETE = "the records show the last binding's container holds this resource already"
    NOT_WANTED = "the last binding's container does not ask for this resource"
    RELEASED = "the records no longer list the last binding, and no init container waits for it"
    PARTNER = "the records and the pod spec show the last binding's container asking for it"
    FALLBACK = "facts missing: steered to the last binding's card"


@dataclass(frozen=True)
class Decision:
    """The partner binding (None: place freely), why, and what was missing if anything."""

    partner: Binding | None
    basis: Basis
    holder: Holder | None = None
    lacking: str | None = None

    @property
    def from_facts(self) -> bool:
        return self.basis is not Basis.FALLBACK


#: What the pod specs say a container asks for (None: unknown).
SpecLookup = Callable[[Holder], Mapping[Resource, int] | None]
#: Whether a pod on record has an ordinary init container asking (bound resource, its
#: size) and (this resource, this size): one that may be mid-admission though unlisted.
InitLookup = Callable[[Resource, int, Resource, int], bool]


@dataclass(frozen=True)
class Facts:
    """What the binder knew when the request arrived.

    ``records``: a PodResources snapshot whose read began after the request arrived,
    or None (``records_missing`` says why). ``specs`` and ``init_waiting``: the pod-spec
    lookups, None when the daemon does not watch pods.
    """

    records: Snapshot | None = None
    records_missing: str = "no PodResources socket"
    specs: SpecLookup | None = None
    init_waiting: InitLookup | None = None


class Pairing:
    """The last binding; :func:`decide` takes the partner decision against it."""

    def __init__(self, window: float = PAIR_WINDOW) -> None:
        self.window = window
        self.last: Binding | None = None

    def wants_records(self, resource: Resource, now: float) -> bool:
        """Whether deciding on ``resource`` now would look at the kubelet's records."""
        last = self.last
        return last is not None and last.resource is not resource and now - last.at <= self.window

    def bound(self, binding: Binding) -> None:
        """An Allocate succeeded: this is now the binding to pair with."""
        self.last = binding

    def refused(self) -> None:
        """An Allocate was refused: the kubelet rejects that pod, so nothing it bound
        before is anybody's partner."""
        self.last = None


def decide(
    last: Binding | None, window: float, resource: Resource, size: int, now: float, facts: Facts
) -> Decision:
    """Whether a request for ``size`` units of ``resource`` arriving at ``now`` is the
    partner of ``last``. The spec lookups in ``facts`` may re-read the pods: call this
    outside any lock the admission path waits on."""
    if last is None or last.resource is resource:
        return Decision(None, Basis.NOTHING_TO_PAIR)
    decision = _from_facts(last, resource, size, facts)
    if decision.basis is Basis.FALLBACK and now - last.at > window:
        # Facts prove nothing and the kubelet asks for a container's resources back to
        # back: a binding this old is nobody's partner. (Facts are never outvoted by age.)
        return Decision(None, Basis.EXPIRED, decision.holder, decision.lacking)
    return decision


def _from_facts(last: Binding, resource: Resource, size: int, facts: Facts) -> Decision:
    if facts.records is None:
        return Decision(last, Basis.FALLBACK, lacking=facts.records_missing)
    holder = facts.records.holder_of(last.resource, last.device_ids[0])
    if holder is None:
        # Not listed: an ordinary init container (PodResources leaves them out), or
        # a pod the kubelet rejected after the binding (it lists active pods only).
        if facts.init_waiting is not None and not facts.init_waiting(
            last.resource, len(last.device_ids), resource, size
        ):
            return Decision(None, Basis.RELEASED)
        return Decision(
            last,
            Basis.FALLBACK,
            lacking="the records do not list the last binding's container "
            "(an init container, or a pod being rejected)",
        )
    held = facts.records.devices.get(holder, {})
    if sorted(held.get(last.resource, ())) != sorted(last.device_ids):
        return Decision(
            last, Basis.FALLBACK, holder, "the records disagree with the last binding"
        )
    if held.get(resource):
        return Decision(None, Basis.COMPLETE, holder)
    wanted = facts.specs(holder) if facts.specs is not None else None
    if wanted is None:
        return Decision(last, Basis.FALLBACK, holder, "the pod spec of the container")
    if wanted.get(last.resource, 0) != len(last.device_ids):
        return Decision(last, Basis.FALLBACK, holder, "a pod spec that matches the records")
    if wanted.get(resource, 0) == 0:
        return Decision(None, Basis.NOT_WANTED, holder)
    if wanted[resource] != size:
        return Decision(last, Basis.FALLBACK, holder, "a pod spec that matches the request")
    return Decision(last, Basis.PARTNER, holder)

