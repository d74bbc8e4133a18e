"""Which enforcement backend holds each card's limits: decided once, at start. Pure.

Memory: ``driver`` (NVIDIA's per-cgroup limit, driver r615+, cgroup v2, a card not in MIG
mode, CDI to carry the hook that sets it), ``interposer`` (HAMi-core's ``libvgpu.so``),
``hardware`` (a MIG device or a card served whole: nothing else shares it), ``soft``
(MPS's pinned device-memory limit, on a card whose compute is ``mps`` and whose memory
cannot be the driver's: a client can drop it), ``none`` (``--no-enforcement``, or a card
offered as time-sliced replicas). Compute: ``mps`` (MPS active-thread caps; the node's
``mpsControl`` configured and present), ``interposer``, ``hardware``, ``none``.

``auto`` takes the strongest backend the card can have; an operator pins one node-wide
or per card (``memoryEnforcement: "auto,0=interposer"``). A pin the card cannot have is
refused with the reason (driver version, MIG on, cgroup v1, no CDI, the self-test),
never silently downgraded. The ``driver`` backend is offered only to a card whose
self-test (set, read back, clear a limit on a scratch cgroup) passed:
:func:`wants_driver_probe` says which cards the daemon must test, :func:`choose` decides
with the results.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpushare.share.cardoverrides import Wording, any_case, overrides_pattern, parse_overrides

#: The first driver branch with per-cgroup GPU memory limits (NVML
#: ``nvmlDeviceSetMemoryLimits_v1``).
MIN_DRIVER_MAJOR = 615
AUTO = "auto"


class MemoryBackend(enum.Enum):
    DRIVER = "driver"
    INTERPOSER = "interposer"
    HARDWARE = "hardware"
    SOFT = "soft"
    NONE = "none"


class ComputeBackend(enum.Enum):
    MPS = "mps"
    INTERPOSER = "interposer"
    HARDWARE = "hardware"
    NONE = "none"


#: What an operator may pin (``none`` comes from ``--no-enforcement`` for memory).
MEMORY_PINS = (AUTO, "driver", "interposer", "hardware")
COMPUTE_PINS = (AUTO, "mps", "interposer", "hardware", "none")

#: Strongest first: what ``auto`` prefers.
MEMORY_STRENGTH = (
    MemoryBackend.HARDWARE,
    MemoryBackend.DRIVER,
    MemoryBackend.INTERPOSER,
    MemoryBackend.SOFT,
    MemoryBackend.NONE,
)
COMPUTE_STRENGTH = (
    ComputeBackend.HARDWARE,
    ComputeBackend.MPS,
    ComputeBackend.INTERPOSER,
    ComputeBackend.NONE,
)


def _pins_pattern(words: Sequence[str]) -> str:
    """``<backend>`` (node-wide) and/or ``<card index or UUID>=<backend>`` entries
    (:mod:`gpushare.share.cardoverrides`)."""
    return overrides_pattern("(" + "|".join(any_case(w) for w in words) + ")")


MEMORY_PINS_PATTERN = _pins_pattern(MEMORY_PINS)
COMPUTE_PINS_PATTERN = _pins_pattern(COMPUTE_PINS)
#: Found in a memoryEnforcement value that pins some card (or the node) to interposer.
PINS_INTERPOSER = f"(^|[=, ]){any_case('interposer')} *(,|$)"


@dataclass(frozen=True)
class Pins:
    """An operator's pins: the node-wide one and those per card (index or UUID)."""

    node: str = AUTO
    cards: Mapping[str, str] | None = None

    def for_card(self, uuid: str, index: int) -> str:
        cards = self.cards or {}
        return cards.get(uuid, cards.get(str(index), self.node))


def parse_pins(text: str, allowed: Sequence[str], what: str = "memoryEnforcement") -> Pins:
    """``auto,0=driver,GPU-1=interposer`` -> :class:`Pins`. ValueError (one line) for a
    word not in ``allowed``, two node-wide words or a card named twice. Exactly what
    the option's pattern accepts parses, unless something is given twice."""

    def backend(part: str, value: str) -> str:
        word = value.lower() if value.isascii() else value
        if word not in allowed:
            raise ValueError(f"{what}: {part!r}: {value!r} is not one of {', '.join(allowed)}")
        return word

    wording = Wording("backend", "backends", "a backend", option=what)
    node, cards = parse_overrides(text, backend, wording)
    return Pins(node or AUTO, cards)


def check_pin_keys(pins: Pins, cards: Sequence[tuple[str, int]], what: str) -> None:
    """ValueError for a pin naming no card of this node (``cards``: UUID, index)."""
    known = {uuid for uuid, _ in cards} | {str(index) for _, index in cards}
    unknown = sorted(set(pins.cards or {}) - known)
    if unknown:
        raise ValueError(f"{what} names no GPU of this node: {', '.join(unknown)}")


@dataclass(frozen=True)
class NodeFacts:
    """What the node offers, the same for every card."""

    driver_version: str | None  # NVML's "615.20.01"; None: unknown
    cgroup: str  # "v2", "v1" or "none" (what is mounted at the cgroup root)
    interposer: bool  # HAMi-core installed (not --no-enforcement)
    mps: bool = False  # an MPS control daemon configured (mpsControl) and present


@dataclass(frozen=True)
class CardTraits:
    """One card as the decision sees it."""

    uuid: str
    index: int
    mig: bool = False  # in MIG mode, served as MIG devices (hardware-isolated)
    #: a MIG device sliced into shared units (``migSharing``): shared, and MIG
    mig_slice: bool = False
    whole_only: bool = False  # served whole only (card mode exclusive)
    cdi: bool = False  # its grants are named to the runtime as CDI devices
    #: the driver self-test: None not run, "" passed, otherwise why it failed
    probe: str | None = None
    timeslice: bool = False  # offered as time-sliced replicas (card mode timeslice)
    #: NVML's PCI address: which ``dmem.capacity`` region is the card's (node/podcgroups.py)
    pci_bus_id: str = ""


@dataclass(frozen=True)
class Choice:
    """A card's backends and, in one line each, why."""

    uuid: str
    index: int
    memory: MemoryBackend
    compute: ComputeBackend
    memory_reason: str
    compute_reason: str


class PinRefused(ValueError):
    """A pinned backend this node cannot give; the message is one line with the reason."""


def driver_major(version: str | None) -> int | None:
    head = (version or "").split(".")[0]
    return int(head) if head.isdigit() else None


def driver_obstacle(node: NodeFacts, card: CardTraits) -> str | None:
    """Why ``driver`` cannot hold this card's memory before any self-test, or None."""
    if card.mig or card.mig_slice:
        return "MIG mode is on (the driver's memory limits do not apply to MIG)"
    if card.whole_only:
        return "the card is served whole only (card mode exclusive)"
    major = driver_major(node.driver_version)
    if major is None:
        return "driver version unknown"
    if major < MIN_DRIVER_MAJOR:
        return f"driver version {node.driver_version} is older than r{MIN_DRIVER_MAJOR}"
    if node.cgroup != "v2":
        return "cgroup v1 (needs cgroup v2)" if node.cgroup == "v1" else "no cgroup v2 mounted"
    if not card.cdi:
        return (
            "no CDI (the hook rides in each grant's CDI spec: set deviceListStrategy "
            "cdi-cri, or serve the card with DRA)"
        )
    return None


def wants_driver_probe(node: NodeFacts, card: CardTraits, pin: str) -> bool:
    """Whether the daemon must self-test ``driver`` on this card before :func:`choose`."""
    return pin in (AUTO, "driver") and driver_obstacle(node, card) is None


def _where(card: CardTraits) -> str:
    return f"card {card.index} ({card.uuid})"


#: why a time-sliced card refuses any enforcement pin (memory and compute alike)
_TIMESLICED = "the card is offered as time-sliced replicas (card mode timeslice: no limits)"


def _cannot_have(setting: str, card: CardTraits, pin: str, why: str) -> PinRefused:
    """The refusal of a pin the card itself rules out (``setting``: the config key)."""
    return PinRefused(f"{setting} pins {_where(card)} to {pin}, which it cannot have: {why}")


def _no_interposer(setting: str, card: CardTraits) -> PinRefused:
    """The refusal of an ``interposer`` pin on a daemon run with --no-enforcement."""
    return PinRefused(
        f"{setting} pins {_where(card)} to interposer, but the daemon runs "
        "with --no-enforcement (no interposer installed)"
    )


def _hardware_why(card: CardTraits) -> str:
    """Why a card held in hardware (MIG or whole) takes no software backend."""
    return "MIG mode is on" if card.mig else "the card is served whole only"


def _memory(node: NodeFacts, card: CardTraits, pin: str) -> tuple[MemoryBackend, str]:
    if card.timeslice:
        if pin != AUTO:
            raise _cannot_have("memoryEnforcement", card, pin, _TIMESLICED)
        return MemoryBackend.NONE, "time-sliced replicas: no limits"
    hardware = card.mig or card.whole_only
    if hardware:
        if pin not in (AUTO, "hardware"):
            why = driver_obstacle(node, card) if pin == "driver" else None
            raise _cannot_have("memoryEnforcement", card, pin, why or _hardware_why(card))
        return MemoryBackend.HARDWARE, "MIG device" if card.mig else "served whole"
    if pin == "hardware":
        raise _cannot_have(
            "memoryEnforcement",
            card,
            pin,
            "the card is shared (hardware needs a MIG device served whole or card mode exclusive)",
        )
    obstacle = driver_obstacle(node, card)
    if obstacle is None and card.probe is None:
        obstacle = "the driver self-test was not run"
    elif obstacle is None and card.probe:
        obstacle = f"the driver self-test failed: {card.probe}"
    if pin == "driver":
        if obstacle is not None:
            raise PinRefused(
                f"memoryEnforcement pins {_where(card)} to driver, which this node cannot "
                f"give: {obstacle}"
            )
        return MemoryBackend.DRIVER, "pinned; self-test passed"
    if pin == "interposer":
        if not node.interposer:
            raise _no_interposer("memoryEnforcement", card)
        return MemoryBackend.INTERPOSER, "pinned"
    if obstacle is None:
        return MemoryBackend.DRIVER, "auto: driver r615+, cgroup v2, CDI, self-test passed"
    if node.interposer:
        return MemoryBackend.INTERPOSER, f"auto: not driver: {obstacle}"
    return MemoryBackend.NONE, "--no-enforcement: limits are advisory"


def _compute(node: NodeFacts, card: CardTraits, pin: str) -> tuple[ComputeBackend, str]:
    if card.timeslice:
        if pin not in (AUTO, "none"):
            raise _cannot_have("computeEnforcement", card, pin, _TIMESLICED)
        return ComputeBackend.NONE, "time-sliced replicas: no limits"
    if card.mig or card.whole_only:
        if pin not in (AUTO, "hardware"):
            raise _cannot_have("computeEnforcement", card, pin, _hardware_why(card))
        return ComputeBackend.HARDWARE, "MIG device" if card.mig else "served whole"
    if pin == "hardware":
        raise _cannot_have(
            "computeEnforcement",
            card,
            pin,
            "the card is shared (hardware needs MIG mode or card mode exclusive)",
        )
    if pin == "mps":
        if not node.mps:
            raise PinRefused(
                f"computeEnforcement pins {_where(card)} to mps, which this node cannot "
                "give: no MPS control daemon (set mpsControl to nvidia-cuda-mps-control)"
            )
        return ComputeBackend.MPS, "pinned"
    if pin == "none":
        return ComputeBackend.NONE, "pinned: no compute cap"
    if pin == "interposer":
        if not node.interposer:
            raise _no_interposer("computeEnforcement", card)
        return ComputeBackend.INTERPOSER, "pinned"
    if node.mps:
        return ComputeBackend.MPS, "auto: MPS control daemon configured (mpsControl)"
    if node.interposer:
        return ComputeBackend.INTERPOSER, "auto: HAMi-core's SM limit"
    return ComputeBackend.NONE, "--no-enforcement: no compute cap"


def choose(node: NodeFacts, card: CardTraits, memory_pin: str, compute_pin: str) -> Choice:
    """The card's backends; :class:`PinRefused` for a pin it cannot have.

    On a card whose compute is ``mps`` the interposer is not loaded (HAMi-core's SM
    limiter would fight the MPS cap): memory is the driver's where it can be, otherwise
    MPS's pinned limit, ``soft``; a memory pin to interposer there is refused."""
    memory, memory_reason = _memory(node, card, memory_pin)
    compute, compute_reason = _compute(node, card, compute_pin)
    if compute is ComputeBackend.MPS and memory in (MemoryBackend.INTERPOSER, MemoryBackend.NONE):
        if memory_pin == "interposer":
            raise PinRefused(
                f"memoryEnforcement pins {_where(card)} to interposer, but its compute is "
                "mps: HAMi-core is not loaded into MPS clients (pin computeEnforcement "
                "interposer, or leave memory auto)"
            )
        memory, memory_reason = (
            MemoryBackend.SOFT,
            f"MPS pinned device-memory limit (a client can drop it); {memory_reason}",
        )
    return Choice(card.uuid, card.index, memory, compute, memory_reason, compute_reason)


def choose_all(
    node: NodeFacts, cards: Sequence[CardTraits], memory: Pins, compute: Pins
) -> list[Choice]:
    """Every card's :class:`Choice`; the first refused pin raises :class:`PinRefused`."""
    return [
        choose(
            node,
            card,
            memory.for_card(card.uuid, card.index),
            compute.for_card(card.uuid, card.index),
        )
        for card in cards
    ]
