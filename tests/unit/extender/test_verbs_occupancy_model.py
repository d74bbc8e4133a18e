"""What occupies a card, as a state machine over the extender's real verbs and ledger.

The world: one node of two cards; pods of one container. The truth is the kubelet's:
which pods are admitted, on which card (the daemon's own placement over the truly
free units). The daemon publishes that truth (counts and the pods they include),
sometimes knowing only pod names (just restarted). The extender sees the published
state the scheduler hands it (maybe an old copy), binds through its verbs, and hears
of bindings and endings through its pod watch, late and in order. Binds, admissions,
publishes, deletions, finishes, watch deliveries and restarts of either side come in
any order. Properties:

* no pod the extender bound is ever refused at admission for lack of room on a card,
  whatever the order the kubelet admits them in among those bound;
* right after the watch delivers an ending, the room is free in the extender's eyes:
  once every bound pod is admitted and published, the extender's rooms are the truth.
"""

from __future__ import annotations

import copy
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from gpushare.extender.fit import CardRoom, fit_pod, pod_need
from gpushare.extender.ledger import AdmissionLedger, PodFacts
from gpushare.extender.verbs import ExtenderPolicy, ExtenderState, bind_verb, filter_verb
from gpushare.kube import nodestate

PREFIX = "gpushare.io"
NODE = "n0"
CARDS = (("GPU-a", 0, 16), ("GPU-b", 1, 12))
NOW = [1000.0]


@dataclass
class Pod:
    name: str
    uid: str
    memory: int
    core: int
    node: str = ""
    card: str = ""  # admitted on
    plan: str = ""  # the card the extender planned (the Binding's annotation)
    ended: bool = False
    deleted: bool = False  # gone from the API server (ended too)

    def obj(self) -> dict[str, Any]:
        limits = {f"{PREFIX}/vcuda-memory": str(self.memory)}
        if self.core:
            limits[f"{PREFIX}/vcuda-core"] = str(self.core)
        return {
            "metadata": {"name": self.name, "namespace": "default", "uid": self.uid},
            "spec": {
                "containers": [{"name": "main", "resources": {"limits": limits}}],
                "nodeName": self.node or None,
            },
            "status": {"phase": "Succeeded" if self.ended else "Pending"},
        }

    def facts(self) -> PodFacts:
        need = pod_need(self.obj(), PREFIX)
        plan = (("main", self.plan),) if self.plan else ()
        return PodFacts(self.uid, f"default/{self.name}", self.node, need, self.ended, plan)


@dataclass
class World:
    pods: dict[str, Pod] = field(default_factory=dict)
    generation: int = 0
    published: str = ""  # the annotation
    scheduler_copy: str = ""  # the scheduler's (maybe older) copy
    names_only: bool = False  # the daemon just restarted: it knows no UIDs yet
    admitted_since_publish: bool = False
    #: the extender restarted after a deletion the published state still shows: no
    #: watch told it, and the API server no longer has the pod (the next publish will)
    deletion_unseen: bool = False

    def free(self) -> dict[str, tuple[int, int]]:
        rooms = {uuid: (units, 100) for uuid, _i, units in CARDS}
        for pod in self.pods.values():
            if pod.card and not pod.ended:
                memory, core = rooms[pod.card]
                rooms[pod.card] = (memory - pod.memory, core - pod.core)
        return rooms

    def rooms(self) -> list[CardRoom]:
        free = self.free()
        return [CardRoom(uuid, i, units, *free[uuid]) for uuid, i, units in CARDS]

    def publish(self) -> None:
        free = self.free()
        cards = []
        for uuid, index, units in CARDS:
            listed = tuple(
                (f"default/{p.name}" if self.names_only else p.uid, p.memory, p.core)
                for p in self.pods.values()
                if p.card == uuid and not p.ended
            )
            memory_free, core_free = free[uuid]
            cards.append(
                nodestate.CardState(
                    uuid=uuid,
                    index=index,
                    name="T",
                    memory_mib=units * 256,
                    memory_units=units,
                    memory_units_used=units - memory_free,
                    core_units=100,
                    core_units_used=100 - core_free,
                    healthy=True,
                    pods=listed,
                )
            )
        self.generation += 1
        state = nodestate.NodeGpuState(self.generation, "", 256, tuple(cards))
        self.published = nodestate.encode(state)
        self.admitted_since_publish = False
        self.deletion_unseen = False

    def node_obj(self, text: str) -> dict[str, Any]:
        return {"metadata": {"name": NODE, "annotations": {f"{PREFIX}/gpus": text}}}


class Occupancy(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.world = World()
        self.world.publish()
        self.world.scheduler_copy = self.world.published
        self.policy = ExtenderPolicy(PREFIX, "binpack")
        self.state = self._fresh_extender()
        self.feed: deque[tuple[str, PodFacts]] = deque()
        self.count = 0

    def _fresh_extender(self) -> ExtenderState:
        ledger = AdmissionLedger(60, clock=lambda: NOW[0])
        ledger.watching = True
        ledger.pods_listed([p.facts() for p in self.world.pods.values() if not p.deleted])
        return ExtenderState(ledger)

    # -- the cluster -------------------------------------------------------------------
    @rule(memory=st.integers(1, 12), core=st.sampled_from([0, 0, 30, 60]))
    def create(self, memory: int, core: int) -> None:
        self.count += 1
        name = f"p{self.count}"
        self.world.pods[name] = Pod(name, f"uid-{self.count}", memory, core)

    def _unbound(self) -> list[Pod]:
        return [p for p in self.world.pods.values() if not p.node and not p.ended]

    def _bound_waiting(self) -> list[Pod]:
        return [p for p in self.world.pods.values() if p.node and not p.card and not p.ended]

    def _live(self) -> list[Pod]:
        return [p for p in self.world.pods.values() if p.node and not p.ended]

    @precondition(lambda self: self._unbound())
    @rule(data=st.data(), fresh_copy=st.booleans())
    def schedule(self, data: st.DataObject, fresh_copy: bool) -> None:
        """kube-scheduler: filter with its copy of the Node, then bind."""
        pod = data.draw(st.sampled_from(self._unbound()))
        if fresh_copy:
            self.world.scheduler_copy = self.world.published
        node = self.world.node_obj(self.world.scheduler_copy)
        body = {"Pod": pod.obj(), "Nodes": {"items": [node]}}
        answer = filter_verb(body, self.policy, self.state)
        if not answer["Nodes"]["items"]:
            return
        binding = {"PodName": pod.name, "PodNamespace": "default", "PodUID": pod.uid, "Node": NODE}
        bound = bind_verb(binding, self.policy, self.state)
        pod.plan = dict(bound.plan).get("main", "")
        pod.node = NODE
        self.feed.append(("MODIFIED", pod.facts()))

    @rule(sizes=st.lists(st.integers(1, 12), min_size=2, max_size=4), data=st.data())
    def burst(self, sizes: list[int], data: st.DataObject) -> None:
        """Several pods created and scheduled back to back, none admitted in between."""
        for memory in sizes:
            self.create(memory, 0)
            self.schedule(data, False)

    @precondition(lambda self: self._bound_waiting())
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """The kubelet admits a bound pod, in any order; the daemon follows the plan
        when it fits (binding.py), else picks by its policy."""
        pod = data.draw(st.sampled_from(self._bound_waiting()))
        need = pod_need(pod.obj(), PREFIX)
        rooms = self.world.rooms()
        planned = [r for r in rooms if r.uuid == pod.plan and r.holds(need.containers[0])]
        fit = fit_pod(planned or rooms, need, "binpack")
        assert fit.placement is not None, (
            f"{pod.name} ({pod.memory} units, {pod.core} cores) bound by the extender finds "
            f"no card: {fit.reason}"
        )
        pod.card = fit.placement.cards[0][0]
        self.world.admitted_since_publish = True

    @precondition(lambda self: self._live())
    @rule(data=st.data(), deleted=st.booleans())
    def end(self, data: st.DataObject, deleted: bool) -> None:
        """A pod is deleted or finishes; the kubelet frees its units at once."""
        pod = data.draw(st.sampled_from(self._live()))
        pod.ended = True
        pod.deleted = deleted
        self.feed.append(("DELETED" if deleted else "MODIFIED", pod.facts()))

    @rule()
    def publish(self) -> None:
        self.world.publish()

    @rule()
    def restart_daemon(self) -> None:
        self.world.names_only = True
        self.world.publish()

    @rule()
    def daemon_learns_uids(self) -> None:
        self.world.names_only = False

    @precondition(lambda self: self.feed)
    @rule()
    def deliver(self) -> None:
        kind, facts = self.feed.popleft()
        if kind == "DELETED":
            self.state.ledger.pod_deleted(facts.uid, facts.key, facts.node)
        else:
            self.state.ledger.pod_seen(facts)

    @rule()
    def restart_extender(self) -> None:
        self.feed.clear()  # a fresh list replaces whatever was on the way
        self.state = self._fresh_extender()
        if any(p.deleted and p.card for p in self.world.pods.values()):
            self.world.deletion_unseen = True

    @rule()
    def time_passes(self) -> None:
        NOW[0] += 30

    # -- properties --------------------------------------------------------------------
    @invariant()
    def ended_room_is_free_at_once(self) -> None:
        """With every bound pod admitted and published, and the watch caught up, the
        extender's rooms are the truth, endings since the publish included."""
        world = self.world
        if self.feed or self._bound_waiting() or world.admitted_since_publish:
            return
        if world.deletion_unseen:
            return
        state = nodestate.decode(self.world.published)
        ledger = copy.deepcopy(self.state.ledger)  # a reading that changes nothing here
        rooms = ledger.occupancy(NODE, state, "binpack").rooms
        seen = {r.uuid: (r.memory_free, r.core_free) for r in rooms}
        assert seen == self.world.free(), (seen, self.world.free())


def occupancy_runs(examples: int) -> None:
    run_state_machine_as_test(
        Occupancy, settings=settings(max_examples=examples, stateful_step_count=40, deadline=None)
    )


def test_occupancy() -> None:
    """make test's size: 50 runs of up to 40 steps."""
    occupancy_runs(50)


@pytest.mark.slow
def test_occupancy_full() -> None:
    """The full size (make test-slow): 400 runs of up to 40 steps."""
    occupancy_runs(400)
