"""The per-card state a node publishes, and the keys of gpushare's labels and annotations.

The daemon writes it on its Node as annotation ``<prefix>/gpus``; the scheduler
extender and ``kubectl gpushare inspect`` read it. JSON, one object per card::

    {"version": 1, "generation": 7, "updated": "2026-11-22T13:00:00Z",
     "memoryUnitMiB": 256,
     "gpus": [{"uuid": "GPU-...", "index": 0, "name": "Tesla P4", "memory_mib": 7611,
               "memory_units": 29, "memory_units_used": 20, "core_units": 100,
               "core_units_used": 30, "healthy": true,
               "held_by": "", "hardware_healthy": true,
               "pods": {"6f1c...": [20, 30]}, "pods_truncated": false}],
     "wholeGpus": [{"uuid": "GPU-...", "index": 1, "name": "A100", "memory_mib": 40960,
                    "healthy": true, "held_by": "ml/train-0/main",
                    "mig": [{"uuid": "MIG-...", "profile": "3g.20gb",
                             "resource": "gpushare.io/mig-3g.20gb", "healthy": true,
                             "held_by": ""}]}]}

``healthy`` of a shared card is whether its units are offered (false while it is held
whole, see ``exclusion.py``): what the scheduler extender places by. ``hardware_healthy``
is the card's own health and ``held_by`` who holds it whole (``namespace/pod/container``);
both were added later and are optional. ``wholeGpus`` lists the cards not offered as
shared units (whole-only cards and MIG cards with their MIG devices), so that readers
see every card the node's ``gpu.count`` label counts.

``kubeletRestarted`` (optional): the UTC time the node's kubelet restarted, present
while the kubelet's PodResources records do not list again every container that held
units before the restart (the counts may then understate what the kubelet holds); the
scheduler extender sends no pod to the node meanwhile.

A card in card mode ``dra`` (served by the DRA driver, not the device plugin) is listed
under ``wholeGpus`` with ``"mode": "dra"`` and what the driver has prepared on it::

    {"uuid": "GPU-...", "index": 2, "name": "Tesla P4", "memory_mib": 7611,
     "healthy": true, "held_by": "", "mig": [], "mode": "dra",
     "memory_used_mib": 5120, "cores_used": 30, "claim_count": 2,
     "memory_total_mib": 7424, "cores_total": 100,
     "claims": [{"namespace": "ml", "claim": "train-0-gpu-x7k", "request": "gpu",
                 "device": "gpu-2", "memory_mib": 4096, "cores": 30}, ...],
     "claims_truncated": false}

A card offered as time-sliced replicas (card mode ``timeslice``) is listed there with
``"mode": "timeslice"``, ``"replicas"`` (offered), ``"replicas_held"`` and ``held_by``
naming its first holders (comma-separated, ``and N more``).

``memory_used_mib``/``cores_used`` add up every claim prepared on the card (memory: the
limits enforced, the rounded ``consumedCapacity``; cores 0: not throttled);
``memory_total_mib``/``cores_total`` are what the card publishes (a card in MIG mode: its
MIG devices' memory together, no cores; absent from older daemons);
``claim_count`` counts them; at most :data:`MAX_CLAIMS_PER_CARD` are listed (then
``claims_truncated``). A claim prepared by a daemon that did not record its size has
``memory_mib``/``cores`` null. The scheduler extender places device-plugin pods by
``gpus`` alone and never looks at these.

``pods`` names what the card's counts include, per pod: its UID (or
``namespace/name`` when the daemon does not know the UID yet) -> the memory and core
units it holds there, as the kubelet's PodResources records showed them. Every pod
listed is included in ``memory_units_used``/``core_units_used``; the counts may hold
more (an Allocate the records do not show yet, or pods left out past
:data:`MAX_PODS_PER_CARD`, then ``pods_truncated`` is true). A daemon that does not
say (older versions) omits both keys: ``CardState.pods`` is then None.
"""

from __future__ import annotations

import calendar
import hashlib
import json
import re
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

VERSION = 1
#: The most pods listed per card (about 50 bytes each); the rest set ``pods_truncated``.
MAX_PODS_PER_CARD = 64
#: Longest pod key read (a UID is 36 characters; ``namespace/name`` at most 317).
MAX_POD_KEY = 320
#: The most DRA claims listed per card; the rest set ``claims_truncated``.
MAX_CLAIMS_PER_CARD = MAX_PODS_PER_CARD
#: Card mode of a card served by the DRA driver.
DRA_MODE = "dra"
TIMESLICE_MODE = "timeslice"
#: The holders of a time-sliced card its ``held_by`` names (the annotation stays small).
MAX_REPLICA_HOLDERS = 4
#: Longest names read from a claim entry: namespace (a DNS label), claim (a DNS
#: subdomain), request (a DNS label, or ``<request>/<subrequest>``), device (a DNS
#: label); and the longest mode.
MAX_NAMESPACE, MAX_CLAIM_NAME, MAX_REQUEST, MAX_DEVICE, MAX_MODE = 63, 253, 127, 63, 16
#: The largest memory (MiB) or count read from a claim entry.
MAX_FIGURE = 1 << 30


@dataclass(frozen=True)
class CardState:
    uuid: str
    index: int
    name: str
    memory_mib: int
    memory_units: int
    memory_units_used: int
    core_units: int
    core_units_used: int
    healthy: bool
    #: ``namespace/pod/container`` holding the card whole ("" when none does).
    held_by: str = ""
    #: The card's own health (None: published by a daemon that did not say).
    hardware_healthy: bool | None = None
    #: pod key (UID, else ``namespace/name``) -> (memory, core) units counted here;
    #: None when the daemon does not say
    pods: tuple[tuple[str, int, int], ...] | None = None
    pods_truncated: bool = False

    @property
    def memory_units_free(self) -> int:
        return max(0, self.memory_units - self.memory_units_used)

    @property
    def core_units_free(self) -> int:
        return max(0, self.core_units - self.core_units_used)


@dataclass(frozen=True)
class MigState:
    """A MIG device served whole, under its card."""

    uuid: str
    profile: str
    resource: str
    healthy: bool
    held_by: str = ""


@dataclass(frozen=True)
class DraClaimState:
    """One device of a ResourceClaim the DRA driver prepared on a card."""

    namespace: str
    claim: str
    request: str
    device: str  # the published device (``gpu-2``, ``gpu-0-mig-1-0``)
    memory_mib: int | None  # the limit enforced; None: not recorded (an older daemon)
    cores: int | None  # percent of the SMs, 0: not throttled; None: not recorded


#: The cores a card in DRA mode publishes (percent of its SMs).
DRA_FULL_CORES = 100


@dataclass(frozen=True)
class WholeCardState:
    """A card not offered as shared units: a whole-only card, a card in MIG mode, or a
    card served by the DRA driver (``mode`` "dra", with its claims)."""

    uuid: str
    index: int
    name: str
    memory_mib: int
    healthy: bool
    held_by: str = ""
    mig: tuple[MigState, ...] = ()
    #: "dra": served by the DRA driver; "" otherwise (the device plugin, or not said)
    mode: str = ""
    #: DRA cards: the claims prepared there (all of them in the daemon; at most
    #: :data:`MAX_CLAIMS_PER_CARD` once published, then ``claims_truncated``)
    claims: tuple[DraClaimState, ...] = ()
    claims_truncated: bool = False
    #: DRA cards: how many claims, and what they add up to (all of them)
    claim_count: int = 0
    memory_used_mib: int = 0
    cores_used: int = 0
    #: DRA cards: what the card publishes in all (memory: the card's rounded down to the
    #: unit, or its MIG devices' together; cores: 100, or 0 for MIG devices); None: not
    #: said (an older daemon)
    memory_total_mib: int | None = None
    cores_total: int | None = None
    #: time-sliced cards (``mode`` "timeslice"): the replicas offered and those held
    #: (``held_by`` then names the first holders, :data:`MAX_REPLICA_HOLDERS` at most)
    replicas: int = 0
    replicas_held: int = 0

    def dra_memory_total(self, unit_mib: int) -> int:
        """What a DRA card publishes as its memory (MiB), as the daemon says; from an
        older daemon, the card's rounded down to the unit."""
        if self.memory_total_mib is not None:
            return self.memory_total_mib
        return self.memory_mib // unit_mib * unit_mib if unit_mib > 0 else self.memory_mib

    def dra_cores_total(self) -> int:
        """The cores a DRA card publishes (0 for a card in MIG mode, whose devices are
        whole; 100 from an older daemon)."""
        return self.cores_total if self.cores_total is not None else DRA_FULL_CORES


def with_replicas(card: WholeCardState, replicas: int, holders: Sequence[str]) -> WholeCardState:
    """``card`` offered as ``replicas`` time-sliced replicas, held by ``holders``
    (``namespace/pod/container``); ``held_by`` names the first few of them."""
    shown = ", ".join(holders[:MAX_REPLICA_HOLDERS])
    if len(holders) > MAX_REPLICA_HOLDERS:
        shown += f" and {len(holders) - MAX_REPLICA_HOLDERS} more"
    return replace(
        card, mode=TIMESLICE_MODE, replicas=replicas, replicas_held=len(holders), held_by=shown
    )


def with_dra_claims(
    card: WholeCardState,
    claims: tuple[DraClaimState, ...],
    published: tuple[int, int] | None = None,
) -> WholeCardState:
    """``card`` served by the DRA driver with ``claims`` prepared on it, their count and
    what they add up to (sizes not recorded count as nothing); ``published``: the
    memory (MiB) and cores the card offers in all."""
    memory_total, cores_total = published if published is not None else (None, None)
    return replace(
        card,
        mode=DRA_MODE,
        claims=claims,
        claim_count=len(claims),
        memory_used_mib=sum(c.memory_mib or 0 for c in claims),
        cores_used=sum(c.cores or 0 for c in claims),
        memory_total_mib=memory_total,
        cores_total=cores_total,
    )


#: Bytes of claims listed per card, about (names plus the JSON around them): tenants
#: name their claims and requests (up to 253 and 63 characters), and every annotation of
#: the Node together must stay under the API server's 256 KiB. Ordinary names fit the
#: :data:`MAX_CLAIMS_PER_CARD`; the rest set ``claims_truncated``.
MAX_CLAIM_BYTES_PER_CARD = 8192
_CLAIM_JSON_BYTES = 90  # keys, quotes and the two numbers of one listed claim


def listed_claims(card: WholeCardState) -> WholeCardState:
    """``card`` as published: at most :data:`MAX_CLAIMS_PER_CARD` claims listed, and
    no more than :data:`MAX_CLAIM_BYTES_PER_CARD` of them."""
    listed: list[DraClaimState] = []
    size = 0
    for claim in card.claims[:MAX_CLAIMS_PER_CARD]:
        size += _CLAIM_JSON_BYTES + sum(
            len(text) for text in (claim.namespace, claim.claim, claim.request, claim.device)
        )
        if size > MAX_CLAIM_BYTES_PER_CARD:
            break
        listed.append(claim)
    if len(listed) == len(card.claims):
        return card
    return replace(card, claims=tuple(listed), claims_truncated=True)


@dataclass(frozen=True)
class Hold:
    """One whole card or MIG device held by one container (the kubelet's records)."""

    resource: str
    device: str
    card: str
    namespace: str
    pod: str
    container: str

    @property
    def holder(self) -> str:
        return f"{self.namespace}/{self.pod}/{self.container}"


#: The most cards whose enforcement is read, and the longest backend name and reason.
MAX_ENFORCED_CARDS, MAX_BACKEND, MAX_REASON = 256, 16, 200


@dataclass(frozen=True)
class CardEnforcement:
    """Which backend holds a card's memory and compute limits (share/backendchoice.py), and
    why its memory backend is what it is (e.g. why not ``driver``)."""

    uuid: str
    index: int
    memory: str  # driver | interposer | hardware | none
    compute: str  # mps | interposer | hardware | none
    why: str = ""


@dataclass(frozen=True)
class CardExtras:
    """What the node knows beyond the shared units: who holds what whole, each card's
    own health, the cards not offered as shared units, and each card's enforcement."""

    holds: tuple[Hold, ...] = ()
    hardware_healthy: dict[str, bool] | None = None
    whole: tuple[WholeCardState, ...] = ()
    enforcement: tuple[CardEnforcement, ...] = ()

    def held_by(self, device: str) -> str:
        """``namespace/pod/container`` holding ``device`` (a card or MIG UUID), or ""."""
        return next((h.holder for h in self.holds if h.device == device), "")


@dataclass(frozen=True)
class NodeGpuState:
    generation: int
    updated: str
    memory_unit_mib: int
    cards: tuple[CardState, ...]
    whole: tuple[WholeCardState, ...] = ()
    #: the UTC time the node's kubelet restarted, while its PodResources records do not
    #: list every container that held units before ("" when they do; issue 32.14)
    kubelet_restarted: str = ""
    #: each card's enforcement backends (absent from an older daemon's annotation)
    enforcement: tuple[CardEnforcement, ...] = ()

    def enforcement_of(self, uuid: str) -> CardEnforcement | None:
        return next((e for e in self.enforcement if e.uuid == uuid), None)


#: ``kubeletRestarted`` is a timestamp: longer text is refused.
MAX_RESTARTED_CHARS = 40


def annotation_key(prefix: str) -> str:
    return f"{prefix}/gpus"


#: The name part of an annotation key (after ``<prefix>/``) is at most 63 characters.
KEY_NAME_LIMIT = 63


def pod_annotation_key(prefix: str, container: str) -> str:
    """``<prefix>/gpu.<container>``; a name too long for a key is shortened with a hash."""
    name = f"gpu.{container}"
    if len(name) > KEY_NAME_LIMIT:
        digest = hashlib.sha256(container.encode()).hexdigest()[:8]
        name = f"{name[: KEY_NAME_LIMIT - 9].rstrip('-._')}-{digest}"
    return f"{prefix}/{name}"


def plan_annotation_key(prefix: str) -> str:
    """``<prefix>/plan``: the card the extender planned for each container of a pod,
    written with the pod's Binding (the API server copies a Binding's annotations onto
    the pod together with ``spec.nodeName``)."""
    return f"{prefix}/plan"


#: The most containers a plan names, and the longest names read from it.
MAX_PLAN_ENTRIES = 64
MAX_PLAN_NAME = 253


def encode_plan(plan: dict[str, str]) -> str:
    return json.dumps(plan, separators=(",", ":"), sort_keys=True)


def decode_plan(text: object) -> dict[str, str]:
    """Container name -> card UUID; anything malformed or too large reads as no plan."""
    if not isinstance(text, str) or len(text) > MAX_PLAN_ENTRIES * 2 * (MAX_PLAN_NAME + 8):
        return {}
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return {}
    if not isinstance(data, dict) or len(data) > MAX_PLAN_ENTRIES:
        return {}
    plan = {}
    for name, uuid in data.items():
        if not isinstance(uuid, str) or not 0 < len(uuid) <= MAX_PLAN_NAME:
            return {}
        if not 0 < len(name) <= MAX_PLAN_NAME:
            return {}
        plan[name] = uuid
    return plan


#: The node labels the daemon publishes, ``<prefix>/gpu.<name>``.
LABEL_NAMES = ("product", "count", "memory", "family", "compute.major", "compute.minor")
#: ...and ``<prefix>/cuda.driver.major|minor`` (see labels.py).
DRIVER_LABEL_NAMES = ("cuda.driver.major", "cuda.driver.minor")
#: ...and ``<prefix>/memory-enforcement`` (the node's one backend, or ``mixed``) with
#: ``<prefix>/memory-enforcement.<backend>`` (how many cards have it); compute alike.
ENFORCEMENT_LABEL_NAMES = ("memory-enforcement", "compute-enforcement")
#: ...and ``<prefix>/persistence-mode``: ``on``, ``off`` or ``mixed`` over the cards whose
#: driver persistence mode NVML tells (absent where it tells none; issue 41 item 6).
PERSISTENCE_LABEL_NAME = "persistence-mode"
MEMORY_BACKENDS = ("driver", "interposer", "soft", "hardware", "none")
COMPUTE_BACKENDS = ("mps", "interposer", "hardware", "none")


def label_key(prefix: str, what: str) -> str:
    """``what`` is one of :data:`LABEL_NAMES`."""
    return f"{prefix}/gpu.{what}"


def label_keys(prefix: str) -> list[str]:
    """Every node label the daemon may write under ``prefix``."""
    memory, compute = ENFORCEMENT_LABEL_NAMES
    return (
        [label_key(prefix, n) for n in LABEL_NAMES]
        + [f"{prefix}/{n}" for n in DRIVER_LABEL_NAMES]
        + [f"{prefix}/{memory}", f"{prefix}/{compute}"]
        + [f"{prefix}/{memory}.{b}" for b in MEMORY_BACKENDS]
        + [f"{prefix}/{compute}.{b}" for b in COMPUTE_BACKENDS]
        + [f"{prefix}/{PERSISTENCE_LABEL_NAME}"]
    )


def _card_json(card: CardState) -> dict[str, Any]:
    data = asdict(card)
    del data["pods"], data["pods_truncated"]
    if card.pods is not None:
        data["pods"] = {key: [memory, core] for key, memory, core in card.pods}
        data["pods_truncated"] = card.pods_truncated
    return data


def _whole_json(card: WholeCardState) -> dict[str, Any]:
    data = asdict(card)
    dra = (
        "mode",
        "claims",
        "claims_truncated",
        "claim_count",
        "memory_used_mib",
        "cores_used",
        "memory_total_mib",
        "cores_total",
    )
    if card.mode != DRA_MODE:  # as before DRA: nothing more for these cards
        for key in dra:
            if key != "mode" or card.mode != TIMESLICE_MODE:
                del data[key]
    else:
        for key in ("memory_total_mib", "cores_total"):
            if data[key] is None:
                del data[key]
    if card.mode != TIMESLICE_MODE:
        del data["replicas"], data["replicas_held"]
    return data


def encode(state: NodeGpuState) -> str:
    return json.dumps(
        {
            "version": VERSION,
            "generation": state.generation,
            "updated": state.updated,
            "memoryUnitMiB": state.memory_unit_mib,
            "gpus": [_card_json(card) for card in state.cards],
            **({"wholeGpus": [_whole_json(card) for card in state.whole]} if state.whole else {}),
            **({"kubeletRestarted": state.kubelet_restarted} if state.kubelet_restarted else {}),
            **(
                {"enforcement": [asdict(e) for e in state.enforcement]}
                if state.enforcement
                else {}
            ),
        },
        separators=(",", ":"),
    )


def _pods(entry: dict[str, Any], where: str) -> tuple[tuple[str, int, int], ...] | None:
    if "pods" not in entry:
        return None
    pods = entry["pods"]
    if not isinstance(pods, dict):
        raise ValueError(f"{where}: 'pods' must be an object")
    if len(pods) > MAX_PODS_PER_CARD:
        raise ValueError(f"{where}: more than {MAX_PODS_PER_CARD} pods listed")
    listed = []
    for key, units in pods.items():
        if not key or len(key) > MAX_POD_KEY:
            raise ValueError(f"{where}: a pod key must have 1 to {MAX_POD_KEY} characters")
        if (
            not isinstance(units, list)
            or len(units) != 2
            or not all(type(n) is int and 0 <= n <= 1 << 30 for n in units)
        ):
            raise ValueError(f"{where}: pod units must be [memory, core], whole numbers")
        listed.append((key, units[0], units[1]))
    return tuple(listed)


def _field(data: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = data.get(key)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{where}: {key!r} must be an integer, got {value!r}")
    if not isinstance(value, kind):
        raise ValueError(f"{where}: {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def _optional(data: dict[str, Any], key: str, kind: type, where: str, default: Any) -> Any:
    return default if data.get(key) is None else _field(data, key, kind, where)


def _name(data: dict[str, Any], key: str, limit: int, where: str) -> str:
    value = _field(data, key, str, where)
    if not 0 < len(value) <= limit:
        raise ValueError(f"{where}: {key!r} must have 1 to {limit} characters")
    return str(value)


def _figure(data: dict[str, Any], key: str, where: str, default: Any) -> Any:
    value = _optional(data, key, int, where, default)
    if value is not None and not 0 <= value <= MAX_FIGURE:
        raise ValueError(f"{where}: {key!r} must be between 0 and {MAX_FIGURE}")
    return value


def _request(claim: dict[str, Any], where: str) -> str:
    value = _optional(claim, "request", str, where, "")
    if len(value) > MAX_REQUEST:
        raise ValueError(f"{where}: 'request' must have at most {MAX_REQUEST} characters")
    return str(value)


def _claims(entry: dict[str, Any], where: str) -> tuple[DraClaimState, ...]:
    listed = _optional(entry, "claims", list, where, [])
    if len(listed) > MAX_CLAIMS_PER_CARD:
        raise ValueError(f"{where}: more than {MAX_CLAIMS_PER_CARD} claims listed")
    claims = []
    for position, claim in enumerate(listed):
        at = f"{where}.claims[{position}]"
        if not isinstance(claim, dict):
            raise ValueError(f"{at} must be an object")
        claims.append(
            DraClaimState(
                namespace=_name(claim, "namespace", MAX_NAMESPACE, at),
                claim=_name(claim, "claim", MAX_CLAIM_NAME, at),
                request=_request(claim, at),
                device=_name(claim, "device", MAX_DEVICE, at),
                memory_mib=_figure(claim, "memory_mib", at, None),
                cores=_figure(claim, "cores", at, None),
            )
        )
    return tuple(claims)


def _decode_whole(entry: Any, where: str) -> WholeCardState:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object")
    mode = _optional(entry, "mode", str, where, "")
    if len(mode) > MAX_MODE:
        raise ValueError(f"{where}: 'mode' must have at most {MAX_MODE} characters")
    devices = []
    for position, device in enumerate(_optional(entry, "mig", list, where, [])):
        at = f"{where}.mig[{position}]"
        if not isinstance(device, dict):
            raise ValueError(f"{at} must be an object")
        devices.append(
            MigState(
                uuid=_field(device, "uuid", str, at),
                profile=_field(device, "profile", str, at),
                resource=_field(device, "resource", str, at),
                healthy=_field(device, "healthy", bool, at),
                held_by=_optional(device, "held_by", str, at, ""),
            )
        )
    return WholeCardState(
        uuid=_field(entry, "uuid", str, where),
        index=_field(entry, "index", int, where),
        name=_field(entry, "name", str, where),
        memory_mib=_field(entry, "memory_mib", int, where),
        healthy=_field(entry, "healthy", bool, where),
        held_by=_optional(entry, "held_by", str, where, ""),
        mig=tuple(devices),
        mode=mode,
        claims=_claims(entry, where),
        claims_truncated=entry.get("claims_truncated") is True,
        claim_count=_figure(entry, "claim_count", where, 0),
        memory_used_mib=_figure(entry, "memory_used_mib", where, 0),
        cores_used=_figure(entry, "cores_used", where, 0),
        memory_total_mib=_figure(entry, "memory_total_mib", where, None),
        cores_total=_figure(entry, "cores_total", where, None),
        replicas=_figure(entry, "replicas", where, 0),
        replicas_held=_figure(entry, "replicas_held", where, 0),
    )


#: The largest annotation read (the API server keeps all of a Node's annotations within
#: 256 KiB), and the deepest nesting (the real one is 5 levels deep): anyone who can
#: write the Node may put anything there, and ``json`` recurses once per level.
MAX_ANNOTATION_BYTES = 256 * 1024
MAX_NESTING = 32
_STRUCTURE = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
#: what :func:`_nesting` drops before counting: whole strings, and runs of anything
#: that is neither a bracket nor a quote (a lone quote, which starts no string, goes next)
_NOT_STRUCTURE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[^\[\]{}"]+')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_INNERMOST = re.compile(r"\[\]|\{\}")


def _brackets(text: str) -> str:
    """``text``'s brackets outside its strings, in order. Without a backslash and with
    an even count of quotes every quote opens or closes a string, so a split finds them
    (the daemon's state has neither escapes nor a lone quote)."""
    if "\\" not in text and text.count('"') % 2 == 0:
        return _NOT_BRACKET.sub("", "".join(text.split('"')[0::2]))
    return _NOT_STRUCTURE.sub("", text).replace('"', "")


def _nesting(text: str, limit: int) -> int:
    """How deep ``text``'s arrays and objects nest (strings skipped), stopping past
    ``limit``; linear, never recursive. The brackets are peeled in C, one level (every
    innermost ``[]`` and ``{}``) per pass, so a state of a few levels costs a few passes;
    text nested past ``limit`` or whose brackets do not pair up (not JSON) is counted one
    token at a time."""
    skeleton = _brackets(text)
    depth = 0
    while skeleton:
        peeled = _INNERMOST.sub("", skeleton)
        if depth > limit or len(peeled) == len(skeleton):
            # deeper than asked (stop early, one by one) or not pairing up
            return _nesting_by_token(text, limit)
        skeleton = peeled
        depth += 1
    return depth


def _nesting_by_token(text: str, limit: int) -> int:
    """:func:`_nesting` one token at a time (for brackets that do not pair up)."""
    depth = deepest = 0
    for match in _STRUCTURE.finditer(text):
        token = match.group()
        if token in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                break
        elif token in "]}":
            depth -= 1
    return deepest


def _enforcement(data: dict[str, Any]) -> tuple[CardEnforcement, ...]:
    """The optional per-card enforcement list, bounded; absent (an older daemon): ()."""
    entries = _optional(data, "enforcement", list, "annotation", [])
    if len(entries) > MAX_ENFORCED_CARDS:
        raise ValueError(f"'enforcement' lists more than {MAX_ENFORCED_CARDS} cards")
    found = []
    for position, entry in enumerate(entries):
        where = f"enforcement[{position}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object")
        found.append(
            CardEnforcement(
                uuid=_name(entry, "uuid", MAX_DEVICE + 33, where),
                index=_field(entry, "index", int, where),
                memory=_name(entry, "memory", MAX_BACKEND, where),
                compute=_name(entry, "compute", MAX_BACKEND, where),
                why=_optional(entry, "why", str, where, "")[:MAX_REASON],
            )
        )
    return tuple(found)


def recency(state: NodeGpuState) -> tuple[float, int]:
    """How recent a published state is, to choose between a node's state object and its
    annotation: its ``updated`` time (an unreadable one sorts first), then its generation
    (a daemon that started counting again is newer by time)."""
    try:
        when = float(calendar.timegm(time.strptime(state.updated, "%Y-%m-%dT%H:%M:%SZ")))
    except (ValueError, OverflowError):
        when = float("-inf")
    return when, state.generation


def decode(text: str) -> NodeGpuState:
    """Parse the annotation; a ValueError says what is wrong with it (also for one too
    large or nested too deep to be ours, checked before parsing)."""
    if not isinstance(text, str):
        raise ValueError("the gpus annotation is not a string")
    if len(text) > MAX_ANNOTATION_BYTES:
        raise ValueError(f"the gpus annotation is larger than {MAX_ANNOTATION_BYTES} bytes")
    if _nesting(text, MAX_NESTING) > MAX_NESTING:
        raise ValueError(f"the gpus annotation nests deeper than {MAX_NESTING} levels")
    try:
        data = json.loads(text)
    except (TypeError, json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"the gpus annotation is not JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise ValueError("the gpus annotation must be a JSON object")
    if data.get("version") != VERSION:
        raise ValueError(f"unsupported gpus annotation version {data.get('version')!r}")
    gpus = _field(data, "gpus", list, "annotation")
    cards = []
    for position, entry in enumerate(gpus):
        where = f"gpus[{position}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be an object")
        cards.append(
            CardState(
                uuid=_field(entry, "uuid", str, where),
                index=_field(entry, "index", int, where),
                name=_field(entry, "name", str, where),
                memory_mib=_field(entry, "memory_mib", int, where),
                memory_units=_field(entry, "memory_units", int, where),
                memory_units_used=_field(entry, "memory_units_used", int, where),
                core_units=_field(entry, "core_units", int, where),
                core_units_used=_field(entry, "core_units_used", int, where),
                healthy=_field(entry, "healthy", bool, where),
                held_by=_optional(entry, "held_by", str, where, ""),
                hardware_healthy=_optional(entry, "hardware_healthy", bool, where, None),
                pods=_pods(entry, where),
                pods_truncated=entry.get("pods_truncated") is True,
            )
        )
    whole = _optional(data, "wholeGpus", list, "annotation", [])
    restarted = _optional(data, "kubeletRestarted", str, "annotation", "")
    if len(restarted) > MAX_RESTARTED_CHARS:
        raise ValueError(f"kubeletRestarted is longer than {MAX_RESTARTED_CHARS} characters")
    return NodeGpuState(
        generation=_field(data, "generation", int, "annotation"),
        updated=str(data.get("updated", "")),
        memory_unit_mib=_field(data, "memoryUnitMiB", int, "annotation"),
        cards=tuple(cards),
        whole=tuple(_decode_whole(e, f"wholeGpus[{i}]") for i, e in enumerate(whole)),
        kubelet_restarted=restarted,
        enforcement=_enforcement(data),
    )
