"""A container never spans two cards: proven over every admission sequence of a small node.

``test_every_sequence`` enumerates ALL sequences of single-container pods (memory
only, core only, both in each kubelet order, sizes that fill two small cards) under
the three regimes of facts (no PodResources; PodResources only; PodResources and pod
specs) and asserts: no container is ever split; with PodResources and specs, no
container is refused while one card could hold it. CI runs sequences of up to
``QUICK_LENGTH`` containers of every kind and one more of the six ``LONG_KINDS``;
``make verify-pairing`` (marker ``slow``) runs up to ``FULL_LENGTH`` and prints the
counts that docs/placement.md quotes.

The worlds are in-process (``pairing_world.py``): the real servicer and binder, the
kubelet stand-in without sockets. The state machine at the end runs over real sockets.
"""

from __future__ import annotations

import itertools
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from conftest import CARD_4GIB, TESLA_P4, Node, cards
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kit.pairing_world import (
    CORE,
    MEMORY,
    REGIMES,
    Outcome,
    Regime,
    World,
    assignment_exists,
    pod_object,
)

from gpushare.deviceplugin.binding import RECORDS_WAIT
from gpushare.share.placement import Policy
from gpushare.sim.kubeletdouble import AdmissionError, ContainerSpec

QUICK_LENGTH = 2  # every kind of container, for make test (3: of LONG_KINDS)
FULL_LENGTH = 4  # every kind of container, for make verify-pairing
LONG_LENGTH = 5  # the reduced kinds of LONG_KINDS, for make verify-pairing
CARD_MIB = (1024, 1024)  # two cards of 4 memory units and 100 core units

Container = tuple[dict[str, int], tuple[str, ...]]


def container_kinds(
    memory_sizes: Sequence[int] = (1, 3),
    core_sizes: Sequence[int] = (30, 80),
    pairs: Sequence[tuple[int, int]] = ((1, 30), (1, 80), (3, 30), (3, 80)),
) -> list[Container]:
    """Memory only, core only, and both in each kubelet order (12 kinds by default)."""
    kinds: list[Container] = []
    for memory in memory_sizes:
        kinds.append(({MEMORY: memory}, (MEMORY,)))
    for core in core_sizes:
        kinds.append(({CORE: core}, (CORE,)))
    for memory, core in pairs:
        kinds.append(({MEMORY: memory, CORE: core}, (MEMORY, CORE)))
        kinds.append(({MEMORY: memory, CORE: core}, (CORE, MEMORY)))
    return kinds


#: Six kinds for the longest sequences: each single resource once, two pairs both ways.
LONG_KINDS = container_kinds((2,), (60,), ((1, 30), (3, 80)))


def sequences(
    length: int, kinds: Sequence[Container] | None = None
) -> Iterator[tuple[Container, ...]]:
    kinds = list(kinds) if kinds is not None else container_kinds()
    for n in range(1, length + 1):
        yield from itertools.product(kinds, repeat=n)


def run_sequence(regime: Regime, sequence: Sequence[Container], policy: Policy) -> Outcome:
    world = World(CARD_MIB, regime, policy=policy)
    total = Outcome()
    for requests, order in sequence:
        total.add(world.admit([(requests, order)]))
    return total


#: make verify-pairing prints a running count at least this often (it runs for minutes).
PROGRESS_SECONDS = 15.0


def enumerate_all(
    length: int,
    policy: Policy = Policy.BINPACK,
    kinds: Sequence[Container] | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, tuple[int, Outcome]]:
    """Every sequence in every regime; ``progress`` gets a running count now and then."""
    results = {}
    planned = sum(1 for _ in sequences(length, kinds)) if progress else 0
    began = shown = time.perf_counter()
    for number, regime in enumerate(REGIMES, 1):
        total, count = Outcome(), 0
        for sequence in sequences(length, kinds):
            total.add(run_sequence(regime, sequence, policy))
            count += 1
            if progress and (now := time.perf_counter()) - shown >= PROGRESS_SECONDS:
                shown = now
                progress(
                    f"  {policy}, regime {number}/{len(REGIMES)} ({regime.name}): "
                    f"{count}/{planned} sequences, {now - began:.0f} s so far"
                )
        results[regime.name] = (count, total)
        if progress:
            progress(
                f"  {policy}, regime {number}/{len(REGIMES)} ({regime.name}): done, {count} "
                f"sequences, {time.perf_counter() - began:.0f} s so far"
            )
    return results


def _to_terminal(line: str) -> None:
    """Past pytest's capture: make verify-pairing's running count."""
    print(line, file=sys.__stderr__, flush=True)


def report(
    length: int, results: dict[str, tuple[int, Outcome]], seconds: float, kinds: int = 12
) -> str:
    lines = [
        f"all sequences of 1..{length} containers of {kinds} kinds "
        "on two cards of 4 units/100 cores:"
    ]
    for name, (count, o) in results.items():
        containers = o.admitted + o.split + o.refused + o.core_only + o.insufficient
        lines.append(
            f"  {name:28} sequences {count:7}  containers {containers:8}  split {o.split}  "
            f"refused {o.refused} (while one card could hold it: {o.needless}; "
            f"core without memory: {o.core_only})  kubelet-insufficient {o.insufficient}"
        )
    lines.append(f"  ({seconds:.1f} s)")
    return "\n".join(lines)


def check(results: dict[str, tuple[int, Outcome]]) -> None:
    for name, (_count, outcome) in results.items():
        assert outcome.split == 0, (name, outcome.details)
    facts = results["PodResources and pod specs"][1]
    assert facts.needless == 0, facts.details


@pytest.mark.parametrize(
    ("policy", "length", "kinds"),
    [
        (Policy.BINPACK, QUICK_LENGTH, None),
        (Policy.BINPACK, QUICK_LENGTH + 1, LONG_KINDS),
        (Policy.SPREAD, QUICK_LENGTH, None),
        pytest.param(Policy.BINPACK, FULL_LENGTH - 1, None, marks=pytest.mark.slow),
    ],
    ids=["binpack-2", "binpack-3-six-kinds", "spread-2", "binpack-3"],
)
def test_every_sequence_never_splits(
    policy: Policy,
    length: int,
    kinds: Sequence[Container] | None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    started = time.perf_counter()
    results = enumerate_all(length, policy, kinds)
    count = len(kinds) if kinds is not None else len(container_kinds())
    with capsys.disabled():
        print(f"\n{policy}: " + report(length, results, time.perf_counter() - started, count))
    check(results)
    # The fallback's price is real: without records, some container is refused needlessly.
    assert results["no PodResources"][1].needless > 0


@pytest.mark.slow
@pytest.mark.parametrize("policy", list(Policy))
def test_every_sequence_full(policy: Policy, capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    results = enumerate_all(FULL_LENGTH, policy, progress=_to_terminal)
    with capsys.disabled():
        print(f"\n{policy}: " + report(FULL_LENGTH, results, time.perf_counter() - started))
    check(results)


@pytest.mark.slow
def test_every_long_sequence(capsys: pytest.CaptureFixture[str]) -> None:
    started = time.perf_counter()
    results = enumerate_all(LONG_LENGTH, Policy.BINPACK, LONG_KINDS, progress=_to_terminal)
    with capsys.disabled():
        print("\n" + report(LONG_LENGTH, results, time.perf_counter() - started, len(LONG_KINDS)))
    check(results)


# -- pods of two containers ----------------------------------------------------------

PRELOADS: tuple[tuple[Container, ...], ...] = (
    (),
    (({MEMORY: 2}, (MEMORY,)),),
    (({MEMORY: 1, CORE: 70}, (MEMORY, CORE)),),
    (({MEMORY: 3, CORE: 30}, (CORE, MEMORY)), ({CORE: 50}, (CORE,))),
)


@pytest.mark.parametrize(
    "kinds",
    [LONG_KINDS, pytest.param(container_kinds(), marks=pytest.mark.slow)],
    ids=["six-kinds", "every-kind"],
)
def test_every_two_container_pod_is_placed_as_a_whole(kinds: list[Container]) -> None:
    """Every pod of two containers (identical ones included), in every kubelet order,
    after every preload: never split; with records and specs, refused only when no
    assignment of its containers to cards could hold the pod. make test pairs the six
    ``LONG_KINDS``; the pairs of all 12 kinds run under ``slow``."""
    results: dict[str, Outcome] = {}
    for regime in REGIMES:
        total = Outcome()
        for preload in PRELOADS:
            for first, second in itertools.product(kinds, repeat=2):
                world = World(CARD_MIB, regime)
                for requests, order in preload:
                    world.admit([(requests, order)])
                total.add(world.admit([first, second]))
        results[regime.name] = total
    for name, outcome in results.items():
        assert outcome.split == 0, (name, outcome.details)
    assert results["PodResources and pod specs"].needless == 0, results[
        "PodResources and pod specs"
    ].details
    assert results["PodResources and pod specs"].admitted > 0


def test_an_init_container_hands_its_units_on_without_a_split() -> None:
    """Ordinary init containers are not in PodResources; their units go to the next
    container (must_include): the pod still lands on one card in every regime."""
    for regime in REGIMES:
        for memory in (1, 3):
            world = World(CARD_MIB, regime)
            world.admit([({MEMORY: 1}, (MEMORY,))])
            init = ({MEMORY: memory, CORE: 30}, (MEMORY, CORE))
            app = ({MEMORY: memory, CORE: 30}, (CORE, MEMORY))
            outcome = world.admit([init, app], init=1)
            assert outcome.split == 0, (regime.name, outcome.details)
            if regime.specs:
                assert outcome.needless == 0, outcome.details


# -- longer and disturbed runs, over real sockets ------------------------------------


class RealNode(RuleBasedStateMachine):
    """Random pods, back to back, through the real daemon and the kubelet stand-in over
    unix sockets, with kubelet restarts, slow and refusing PodResources, and deletions.
    No container is ever split; while PodResources answers promptly and the pod specs
    are known, no pod is refused that some assignment of its containers could hold."""

    specs_on = True
    records_on = True

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
        self.node = Node(self.root)
        if self.specs_on:
            self.node.with_pod_specs()
        if not self.records_on:
            self.node.kubelet.pod_resources_socket = None
        self.node.start(cards(CARD_4GIB, 2))
        self.pods: list[str] = []
        self.count = 0
        self.facts_degraded = False

    def teardown(self) -> None:
        self.node.stop()
        shutil.rmtree(self.root, ignore_errors=True)

    def free(self) -> dict[str, list[int]]:
        node = self.node
        assert node.daemon is not None and node.daemon.core is not None
        cards_now = node.daemon.core.inventory.cards.values()
        free = {
            card.uuid: [card.memory_units, 100] for card in cards_now
        }
        for record in node.kubelet.admitted.values():
            for resource, ids in record.devices.items():
                for device_id in ids:
                    free[device_id.split("::")[0]][0 if resource == node.memory else 1] -= 1
        return free

    def fits(self, needs: list[tuple[int, int]]) -> bool:
        return assignment_exists(self.free(), needs)

    @rule(
        needs=st.lists(
            st.tuples(st.integers(0, 8), st.sampled_from([0, 10, 40, 70])).filter(any),
            min_size=1,
            max_size=2,
        ),
        reverse=st.lists(st.booleans(), min_size=2, max_size=2),
    )
    def admit(self, needs: list[tuple[int, int]], reverse: list[bool]) -> None:
        node = self.node
        self.count += 1
        name = f"p{self.count}"
        containers = []
        for i, (memory, core) in enumerate(needs):
            requests = {r: n for r, n in ((node.memory, memory), (node.core, core)) if n}
            order = list(requests)[::-1] if reverse[i] else list(requests)
            containers.append((f"c{i}", requests, order))
        if node.specs is not None:
            node.specs.update(
                pod_object(name, [ContainerSpec(c, r) for c, r, _ in containers])
            )
        could_fit = self.fits(needs)
        assert node.daemon is not None and node.daemon.core is not None
        # a read ran out: the daemon decides without records until one is answered
        unanswered = node.daemon.core.pod_resources.unanswered
        refused = None
        for container, requests, order in containers:
            try:
                record = node.kubelet.admit(name, container, requests, order=order)
            except AdmissionError as exc:
                refused = exc
                break
            cards_used = {d.split("::")[0] for ids in record.devices.values() for d in ids}
            assert len(cards_used) == 1 and record.conflicts == [], record.devices
            assert record.card() in cards_used
        if refused is None:
            self.pods.append(name)
            if node.specs is not None:  # started: the watch reports it Running
                specs = [ContainerSpec(c, r) for c, r, _ in containers]
                node.specs.update(pod_object(name, specs, phase="Running"))
            return
        if node.specs is not None:  # the watch reports the rejected pod as Failed
            specs = [ContainerSpec(c, r) for c, r, _ in containers]
            node.specs.update(pod_object(name, specs, phase="Failed"))
        facts = self.specs_on and self.records_on and not self.facts_degraded and not unanswered
        if "no GPU memory limit" in refused.message:  # by rule: cores need memory
            assert any(core and not memory for memory, core in needs), refused
        elif refused.reason != "OutOfResources" and facts:
            assert not could_fit, f"{name} {needs} refused needlessly: {refused}"

    @precondition(lambda self: bool(self.pods))
    @rule(data=st.data())
    def delete(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(self.pods))
        self.pods.remove(name)
        self.node.kubelet.release(name)

    @rule()
    def restart_kubelet(self) -> None:
        count = len(self.node.kubelet.registrations)
        self.node.kubelet.restart()
        assert self.node.kubelet.wait_for(lambda k: len(k.registrations) >= count + 2, 30.0)
        assert self.node.wait_registered(10.0)

    @rule(pace=st.sampled_from(["prompt", "slow", "past the wait"]))
    def slow_pod_resources(self, pace: str) -> None:
        """A kubelet that answers List at once, after 300 ms (past the 0.2 s the binder
        waited before issue 32.18: no refusal is needless), or later than a binder told
        to wait 0.1 s (the fallback: refusals allowed, never a split)."""
        assert self.node.daemon is not None and self.node.daemon.plugin is not None
        binder = self.node.daemon.plugin.binder
        self.node.kubelet.list_delay = 0.0 if pace == "prompt" else 0.3
        binder.records_wait = 0.1 if pace == "past the wait" else RECORDS_WAIT
        self.facts_degraded = pace == "past the wait"


class RealNodeWithoutSpecs(RealNode):
    specs_on = False


class RealNodeWithoutPodResources(RealNode):
    records_on = False


@pytest.mark.parametrize(
    "machine",
    [RealNode, RealNodeWithoutSpecs, RealNodeWithoutPodResources],
    ids=["facts", "without-specs", "without-pod-resources"],
)
@pytest.mark.parametrize(
    "runs", [2, pytest.param(4, marks=pytest.mark.slow)], ids=["2-runs", "4-runs"]
)
def test_real_node(machine: type[RealNode], runs: int) -> None:
    """Runs of up to 10 steps: 2 in make test, 4 under ``slow`` (make verify-pairing)."""
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=runs,
            stateful_step_count=10,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )


# -- the sequences that split containers before, over real sockets --------------------


@pytest.mark.parametrize("regime", REGIMES, ids=lambda r: r.name)
def test_core_only_then_a_pair_asked_memory_first_is_never_split(
    node: Node, regime: Regime
) -> None:
    """Seen with the kubelet's device manager: ``vcuda-core=5``, then
    ``vcuda-memory=2,vcuda-core=23`` allocated memory first went memory on GPU0, cores
    on GPU1, and Allocate accepted it."""
    if not regime.records:
        node.kubelet.pod_resources_socket = None
    if regime.specs:
        node.with_pod_specs()
    node.start(cards(TESLA_P4, 2))
    node.pod("a", {node.core: 5})
    if regime.specs:  # its spec shows no memory units: refused
        with pytest.raises(AdmissionError, match="no GPU memory limit"):
            node.kubelet.admit("a", "main", {node.core: 5})
    else:
        node.kubelet.admit("a", "main", {node.core: 5})
    node.pod("b", {node.memory: 2, node.core: 23})
    try:
        b = node.kubelet.admit(
            "b", "main", {node.memory: 2, node.core: 23}, order=[node.memory, node.core]
        )
    except AdmissionError as refused:
        assert not regime.specs, refused  # with the facts, nothing stands in its way
        assert "no single card holds both" in refused.message
        return
    assert {d.split("::")[0] for ids in b.devices.values() for d in ids} == {b.card()}
    assert b.conflicts == []


@pytest.mark.parametrize("core_first", [True, False])
def test_the_spec_of_a_running_pod_holding_the_last_binding_is_used(
    node: Node, core_first: bool
) -> None:
    """Seen with the real device manager: a memory-only pod admitted
    and already Running, then a container asking both whose core comes first. The
    records name the Running pod's container as the holder of the last binding; its
    spec (no cores) proves the request is not its partner. Looking up Pending pods only,
    the binder fell back to steering the cores to the memory-only pod's card, where 90
    cores were taken, and refused a container that the other card holds."""
    node.with_pod_specs()
    node.start(cards(TESLA_P4, 2))
    first = node.pod("c90", {node.memory: 1, node.core: 90})
    held = node.kubelet.admit("c90", "main", {node.memory: 1, node.core: 90})
    node.specs.update(first | {"status": {"phase": "Running"}})  # type: ignore[union-attr]
    second = node.pod("m2", {node.memory: 2})
    small = node.kubelet.admit("m2", "main", {node.memory: 2})
    assert small.card() == held.card()  # binpack: the memory-only pod joins the first card
    node.specs.update(second | {"status": {"phase": "Running"}})  # type: ignore[union-attr]
    requests = {node.memory: 1, node.core: 49}
    node.pod("c49", requests)
    order = [node.core, node.memory] if core_first else [node.memory, node.core]
    record = node.kubelet.admit("c49", "main", requests, order=order)
    assert {d.split("::")[0] for ids in record.devices.values() for d in ids} == {record.card()}
    assert record.card() != held.card()


def test_a_kubelet_slower_than_the_binders_wait_costs_refusals_never_a_split(
    node: Node,
) -> None:
    """PodResources answering after the binder's wait: the fallback steers."""
    node.with_pod_specs()
    daemon = node.start(cards(TESLA_P4, 2))
    assert daemon.plugin is not None
    daemon.plugin.binder.records_wait = 0.1
    node.kubelet.list_delay = 0.3
    admitted = refused = 0
    for i, (memory, core, memory_first) in enumerate(
        [(4, 10, True), (0, 60, True), (20, 30, False), (6, 0, True), (3, 50, False)] * 2
    ):
        requests = {r: n for r, n in ((node.memory, memory), (node.core, core)) if n}
        order = list(requests) if memory_first else list(requests)[::-1]
        node.pod(f"s{i}", requests)
        try:
            record = node.kubelet.admit(f"s{i}", "main", requests, order=order)
        except AdmissionError:
            refused += 1
            continue
        admitted += 1
        assert {d.split("::")[0] for ids in record.devices.values() for d in ids} == {
            record.card()
        }
    assert admitted > 0
