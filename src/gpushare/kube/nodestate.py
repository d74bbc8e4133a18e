"""The per-card state a node publishes, and the keys of gpushare's labels and annotations.

The daemon writes it on its Node as annotation ``<prefix>/gpus``; the scheduler
extender and ``kubectl gpushare inspect`` read it. JSON, one object per card::

    {"version": 1, "generation": 7, "updated": "2026-11-22T13:00:00Z",
     "memoryUnitMiB": 256,
     "gpus": [{"uuid": "GPU-...", "index": 0, "name": "Tesla P4", "memory_mib": 7611,
               "memory_units": 29, "memory_units_used": 20, "core_units": 100,
               "core_units_used": 30, "healthy": true,
               "held_by": "", "hardware_healthy": true}],
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
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

VERSION = 1


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
class WholeCardState:
    """A card not offered as shared units: a whole-only card or a card in MIG mode."""

    uuid: str
    index: int
    name: str
    memory_mib: int
    healthy: bool
    held_by: str = ""
    mig: tuple[MigState, ...] = ()


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


@dataclass(frozen=True)
class CardExtras:
    """What the node knows beyond the shared units: who holds what whole, each card's
    own health, and the cards not offered as shared units."""

    holds: tuple[Hold, ...] = ()
    hardware_healthy: dict[str, bool] | None = None
    whole: tuple[WholeCardState, ...] = ()

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


#: The node labels the daemon publishes, ``<prefix>/gpu.<name>``.
LABEL_NAMES = ("product", "count", "memory", "family", "compute.major", "compute.minor")
#: ...and ``<prefix>/cuda.driver.major|minor`` (see labels.py).
DRIVER_LABEL_NAMES = ("cuda.driver.major", "cuda.driver.minor")


def label_key(prefix: str, what: str) -> str:
    """``what`` is one of :data:`LABEL_NAMES`."""
    return f"{prefix}/gpu.{what}"


def label_keys(prefix: str) -> list[str]:
    """Every node label the daemon may write under ``prefix``."""
    return [label_key(prefix, n) for n in LABEL_NAMES] + [
        f"{prefix}/{n}" for n in DRIVER_LABEL_NAMES
    ]


def encode(state: NodeGpuState) -> str:
    return json.dumps(
        {
            "version": VERSION,
            "generation": state.generation,
            "updated": state.updated,
            "memoryUnitMiB": state.memory_unit_mib,
            "gpus": [asdict(card) for card in state.cards],
            **({"wholeGpus": [asdict(card) for card in state.whole]} if state.whole else {}),
        },
        separators=(",", ":"),
    )


def _field(data: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = data.get(key)
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{where}: {key!r} must be an integer, got {value!r}")
    if not isinstance(value, kind):
        raise ValueError(f"{where}: {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def _optional(data: dict[str, Any], key: str, kind: type, where: str, default: Any) -> Any:
    return default if data.get(key) is None else _field(data, key, kind, where)


def _decode_whole(entry: Any, where: str) -> WholeCardState:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object")
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
    )


def decode(text: str) -> NodeGpuState:
    """Parse the annotation; a ValueError says what is wrong with it."""
    try:
        data = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"the gpus annotation is not JSON: {exc}") from None
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
            )
        )
    whole = _optional(data, "wholeGpus", list, "annotation", [])
    return NodeGpuState(
        generation=_field(data, "generation", int, "annotation"),
        updated=str(data.get("updated", "")),
        memory_unit_mib=_field(data, "memoryUnitMiB", int, "annotation"),
        cards=tuple(cards),
        whole=tuple(_decode_whole(e, f"wholeGpus[{i}]") for i, e in enumerate(whole)),
    )
