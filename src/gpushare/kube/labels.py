"""GPU-model node labels in the style of NVIDIA's GPU feature discovery (GFD). Pure.

``<prefix>/gpu.product`` is the NVML name sanitised as GFD does it (every character
outside ``[A-Za-z0-9-_. ]`` removed, runs of spaces turned into one ``-``, so
``NVIDIA A100-PCIE-40GB`` -> ``NVIDIA-A100-PCIE-40GB``), then made a valid label
value (at most 63 characters, starting and ending alphanumeric): a name that would
not be one is cleaned, never a reason for the Node patch to fail. With
``nvidiaProductLabel`` the same value is also written as ``nvidia.com/gpu.product``,
for nodes without GFD whose workloads select on it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpushare.gpu.gpus import Gpu
from gpushare.kube import nodestate

LABEL_VALUE_LIMIT = 63
NVIDIA_PRODUCT_LABEL = "nvidia.com/gpu.product"

_OUTSIDE_GFD = re.compile(r"[^A-Za-z0-9\-_. ]")
_EDGE = re.compile(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$")


def gfd_sanitise(name: str) -> str:
    """GFD's product name: characters outside ``[A-Za-z0-9-_. ]`` removed, then the
    space-separated words joined by ``-``."""
    return "-".join(_OUTSIDE_GFD.sub("", name).split())


def label_value(text: str) -> str:
    """A valid label value from ``text`` (empty, or <= 63 characters from
    ``[A-Za-z0-9-_.]`` that start and end alphanumeric)."""
    value = _EDGE.sub("", re.sub(r"[^A-Za-z0-9\-_.]", "", text))
    return _EDGE.sub("", value[:LABEL_VALUE_LIMIT])


def product_label(name: str) -> str:
    return label_value(gfd_sanitise(name))


def arch_family(major: int, minor: int) -> str:
    """GFD's architecture family of a CUDA compute capability."""
    families = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper"}
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    if major in (10, 12):
        return "blackwell"
    return families.get(major, "undefined")


@dataclass(frozen=True)
class LabelFacts:
    """What the labels are made of: the node's cards (any mode), the CUDA driver."""

    gpus: Sequence[Gpu] = field(default_factory=tuple)
    cuda_driver: tuple[int, int] | None = None
    nvidia_product: bool = False
    #: each card's enforcement backends (node/backendfacts.py)
    enforcement: Sequence[nodestate.CardEnforcement] = field(default_factory=tuple)


def enforcement_labels(
    prefix: str, enforcement: Sequence[nodestate.CardEnforcement]
) -> dict[str, str]:
    """``<prefix>/memory-enforcement``: the backend every card has, or ``mixed``;
    ``<prefix>/memory-enforcement.<backend>``: how many cards have it (select nodes with
    at least one ``driver`` card by the key's existence). Compute alike."""
    labels: dict[str, str] = {}
    memory_name, compute_name = nodestate.ENFORCEMENT_LABEL_NAMES
    for name, values in (
        (memory_name, [e.memory for e in enforcement]),
        (compute_name, [e.compute for e in enforcement]),
    ):
        if not values:
            continue
        kinds = sorted(set(values))
        labels[f"{prefix}/{name}"] = kinds[0] if len(kinds) == 1 else "mixed"
        for kind in kinds:
            labels[f"{prefix}/{name}.{label_value(kind)}"] = str(values.count(kind))
    return labels


def persistence_labels(prefix: str, gpus: Sequence[Gpu]) -> dict[str, str]:
    """``<prefix>/persistence-mode``: ``on`` or ``off`` where every card NVML tells agrees,
    else ``mixed``; none where no card's mode is known (a simulated node that states none).
    Without persistence mode the driver is torn down whenever no process holds it open,
    and the next open (the memory hook's, per container) pays about 2 s to set it up
    again: select or taint on this label to keep ``driver`` workloads off such nodes."""
    modes = {g.persistence_mode for g in gpus if g.persistence_mode is not None}
    if not modes:
        return {}
    value = "mixed" if len(modes) > 1 else ("on" if modes.pop() else "off")
    return {f"{prefix}/{nodestate.PERSISTENCE_LABEL_NAME}": value}


def node_labels(prefix: str, facts: LabelFacts) -> dict[str, str]:
    """The node's labels; the model facts come from its first card (by index)."""
    gpus = sorted(facts.gpus, key=lambda g: g.index)
    if not gpus:
        return {}
    first = gpus[0]
    product = product_label(first.name)
    gpu = {"product": product, "count": str(len(gpus)), "memory": str(first.memory_mib)}
    if first.compute_capability is not None:
        major, minor = first.compute_capability
        gpu |= {
            "family": arch_family(major, minor),
            "compute.major": str(major),
            "compute.minor": str(minor),
        }
    labels = {nodestate.label_key(prefix, what): value for what, value in gpu.items()}
    if facts.cuda_driver is not None:
        major_key, minor_key = nodestate.DRIVER_LABEL_NAMES
        labels[f"{prefix}/{major_key}"] = str(facts.cuda_driver[0])
        labels[f"{prefix}/{minor_key}"] = str(facts.cuda_driver[1])
    if facts.nvidia_product:
        labels[NVIDIA_PRODUCT_LABEL] = product
    labels |= persistence_labels(prefix, gpus)
    return labels | enforcement_labels(prefix, facts.enforcement)
