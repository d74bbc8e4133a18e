"""A node's occupancy, and its verdict per pod shape, kept until what they came from changes.

A filter or prioritize by names asks the same question of hundreds of nodes, and most of
them have not changed since the last request: their published state is the same object
(the node watch decodes it once per change, ``nodecache.py``) and nothing the ledger
counts on them moved. So the ledger's occupancy of a node (``ledger.py``) is kept with
what it was computed from, and, beside it, the verdict of each pod shape asked there
(what the pod's containers need, its card choice): a request is then a dictionary
look-up per node, and the fitting runs only for nodes that changed or shapes not seen.

Nothing here decides: a miss calls the ledger's occupancy and the one placement
(``fit.py`` over ``share/placement.py``), and a kept answer is returned only while each
thing it depends on is as it was:

* the node's published state (the same object) and the placement policy;
* the ledger's ``version`` of the node (it changes with every hold, live pod and ended
  pod counted there) and whether the pod watch runs;
* the clock, where the answer depends on it (a hold or pod the state cannot confirm
  counts until its timeout: ``Occupancy.oldest``);
* which of the pods the state lists have ended anywhere (``Occupancy.listed``);
* for a request that leaves a pod out (``exclude_pod``: prioritize scores a pod without
  its own hold), that the pod is not one the answer counts (``Occupancy.touched``);
  otherwise the answer is computed afresh and not kept.

Everything kept is bounded: past a bound it is dropped whole.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gpushare.extender.fit import CardRoom
from gpushare.extender.ledger import AdmissionLedger, Occupancy
from gpushare.kube.nodestate import NodeGpuState

V = TypeVar("V")

#: The most nodes kept, and the most pod shapes told apart, before all is dropped.
MAX_NODES = 50_000
MAX_SHAPES = 4096
#: The most shapes kept per node before that node's are dropped.
MAX_SHAPES_PER_NODE = 8


@dataclass
class _Entry(Generic[V]):
    state: NodeGpuState
    policy: str
    watching: bool
    version: tuple[int, int]
    occupancy: Occupancy
    gone: frozenset[str]
    #: shape id -> what the caller made of this occupancy for that shape
    memo: dict[int, V] = field(default_factory=dict)


class VerdictCache(Generic[V]):
    """node name -> its occupancy and per-shape answers (one event loop, no locks)."""

    def __init__(self) -> None:
        self._nodes: dict[str, _Entry[V]] = {}
        self._shapes: dict[Hashable, int] = {}
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def shape(self, key: Hashable) -> int:
        """A small number for a pod shape (hashed once per request, not once per node)."""
        found = self._shapes.get(key)
        if found is None:
            if len(self._shapes) >= MAX_SHAPES:
                self._shapes.clear()
                self._nodes.clear()  # the numbers are given out again
            found = self._shapes[key] = len(self._shapes)
        return found

    def _valid(self, entry: _Entry[V], ledger: AdmissionLedger, node: str) -> bool:
        occupancy = entry.occupancy
        return (
            entry.version == ledger.version(node)
            and entry.watching == ledger.watching
            and occupancy.oldest >= ledger.now() - ledger.timeout_seconds
            and ledger.gone_among(occupancy.listed) == entry.gone
        )

    def occupancy(
        self,
        ledger: AdmissionLedger,
        node: str,
        state: NodeGpuState,
        policy: str,
        exclude_pod: str = "",
        rooms: tuple[CardRoom, ...] | None = None,
    ) -> tuple[Occupancy, dict[int, V] | None]:
        """``ledger.occupancy(...)`` now, and the node's memo of answers per shape for
        it (None when this answer is not the kept one: nothing may be memoised)."""
        ledger.expire()
        entry = self._nodes.get(node)
        if (
            entry is not None
            and entry.state is state
            and entry.policy == policy
            and self._valid(entry, ledger, node)
        ):
            self.hits += 1
        else:
            self.misses += 1
            found = ledger.occupancy(node, state, policy, "", rooms)
            if len(self._nodes) >= MAX_NODES and node not in self._nodes:
                self._nodes.clear()
            entry = _Entry(
                state,
                policy,
                ledger.watching,
                ledger.version(node),
                found,
                ledger.gone_among(found.listed),
            )
            self._nodes[node] = entry
        if exclude_pod and exclude_pod in entry.occupancy.touched:
            return ledger.occupancy(node, state, policy, exclude_pod, rooms), None
        if len(entry.memo) >= MAX_SHAPES_PER_NODE:
            entry.memo.clear()
        return entry.occupancy, entry.memo
