"""Which whole cards to give a container together: NVLink, then NUMA, then PCIe. Pure.

A multi-card container runs fastest on cards joined by NVLink, then on cards of one
NUMA node, then under one PCIe switch. A one-card container should take a card
whose NVLink partners are already taken, so that pairs stay whole for the
containers that need them. :func:`prefer` scores every candidate set by, in order:

1. NVLink links inside the set (more is better);
2. NVLink links from the set to available cards left out (fewer: no pair broken);
3. pairs of the set on one NUMA node (more);
4. pairs of the set under one PCIe switch (more);
5. the cards' positions (lowest first), so the answer is stable.

Sets are enumerated exhaustively up to :data:`EXHAUSTIVE_LIMIT` candidates (8 cards,
any size: 70 at most), else built greedily card by card with the same score.

Where the facts come from: the simulated node file's ``topology`` section, or NVML
(``nvmlDeviceGetTopologyCommonAncestor`` for the PCIe level of each pair,
``nvmlDeviceGetNvLinkState`` / ``nvmlDeviceGetNvLinkRemotePciInfo`` per link).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

#: Above this many candidate sets, choose greedily.
EXHAUSTIVE_LIMIT = 5000


def pair(a: str, b: str) -> frozenset[str]:
    return frozenset((a, b))


@dataclass(frozen=True)
class Topology:
    """How the cards (by UUID) are joined. Anything unknown is simply absent."""

    nvlinks: Mapping[frozenset[str], int] = field(default_factory=dict)  # pair -> links
    numa: Mapping[str, int | None] = field(default_factory=dict)
    switch: Mapping[str, str] = field(default_factory=dict)  # card -> its PCIe switch

    def links(self, a: str, b: str) -> int:
        return self.nvlinks.get(pair(a, b), 0)

    def same_numa(self, a: str, b: str) -> bool:
        node = self.numa.get(a)
        return node is not None and node == self.numa.get(b)

    def same_switch(self, a: str, b: str) -> bool:
        switch = self.switch.get(a)
        return switch is not None and switch == self.switch.get(b)

    def partners(self, card: str) -> list[str]:
        """Cards with an NVLink to ``card``."""
        return sorted(other for p in self.nvlinks for other in p if card in p and other != card)


def _score(
    chosen: Sequence[str], left: Iterable[str], topology: Topology, position: Mapping[str, int]
) -> tuple[int, ...]:
    """Smaller is better (see the module docstring)."""
    inside = numa = switch = 0
    for a, b in itertools.combinations(chosen, 2):
        inside += topology.links(a, b)
        numa += topology.same_numa(a, b)
        switch += topology.same_switch(a, b)
    cut = sum(topology.links(a, b) for a in chosen for b in left)
    return (-inside, cut, -numa, -switch, *sorted(position[c] for c in chosen))


def prefer(
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    topology: Topology,
    position: Mapping[str, int] | None = None,
) -> list[str]:
    """The best ``size`` cards of ``available`` that include ``must_include``, in the
    order of their positions (default: their order in ``available``)."""
    position = dict(position or {c: i for i, c in enumerate(available)})
    for card in available:
        position.setdefault(card, len(position))
    required = list(dict.fromkeys(c for c in must_include if c in available))
    pool = [c for c in available if c not in required]
    wanted = max(0, min(size, len(available)) - len(required))
    if math.comb(len(pool), wanted) <= EXHAUSTIVE_LIMIT:
        best = min(
            ([*required, *extra] for extra in itertools.combinations(pool, wanted)),
            key=lambda s: _score(s, (c for c in available if c not in s), topology, position),
        )
    else:
        best = list(required)
        for _ in range(wanted):
            rest = [c for c in pool if c not in best]
            best.append(
                min(
                    rest,
                    key=lambda c: _score(
                        [*best, c],
                        (o for o in available if o not in best and o != c),
                        topology,
                        position,
                    ),
                )
            )
    return sorted(best, key=lambda c: position[c])


# --------------------------------------------------------------------------- reading it


def from_description(
    data: object, by_key: Mapping[str, str], numa: Mapping[str, int | None]
) -> Topology:
    """The ``topology`` section of a simulated node file; ``by_key`` maps each card's
    index (as text) and UUID to its UUID. Raises ValueError naming what is wrong::

        topology:
          nvlink:            # groups of cards joined pairwise, or {cards: [...], links: N}
            - [0, 1]
            - {cards: [2, 3], links: 4}
          pcie_switches:     # cards under one PCIe switch
            - [0, 1, 2, 3]
    """
    if data is None:
        return Topology(numa=dict(numa))
    if not isinstance(data, dict):
        raise ValueError("'topology' must be a mapping")
    unknown = set(data) - {"nvlink", "pcie_switches"}
    if unknown:
        raise ValueError(f"'topology' has unknown keys: {', '.join(sorted(map(str, unknown)))}")

    def cards_of(group: object, where: str) -> list[str]:
        if not isinstance(group, list) or len(group) < 2:
            raise ValueError(f"{where} must list at least two cards")
        found = []
        for key in group:
            uuid = by_key.get(str(key))
            if uuid is None:
                raise ValueError(f"{where} names no card of this node: {key!r}")
            found.append(uuid)
        return found

    nvlinks: dict[frozenset[str], int] = {}
    for i, entry in enumerate(data.get("nvlink") or []):
        where = f"topology.nvlink[{i}]"
        links = 1
        if isinstance(entry, dict):
            links = entry.get("links", 1)
            if not isinstance(links, int) or isinstance(links, bool) or links < 1:
                raise ValueError(f"{where}: links must be a positive integer")
            entry = entry.get("cards")
        for a, b in itertools.combinations(cards_of(entry, where), 2):
            nvlinks[pair(a, b)] = nvlinks.get(pair(a, b), 0) + links
    switch: dict[str, str] = {}
    for i, group in enumerate(data.get("pcie_switches") or []):
        for uuid in cards_of(group, f"topology.pcie_switches[{i}]"):
            switch[uuid] = f"switch-{i}"
    return Topology(nvlinks=nvlinks, numa=dict(numa), switch=switch)
