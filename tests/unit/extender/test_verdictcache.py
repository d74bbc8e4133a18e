"""The verdict cache answers what the uncached computation answers, whatever happened.

Two ledgers live the same history on one clock: holds recorded and forgotten, pods
seen, deleted and listed by the watch, the watch stopping and starting, the clock
moving past timeouts; between any two steps a node is judged for a pod (any shape, any
card choice, with or without a pod left out, either policy, any of a few published
states: listing pods by UID or by name, truncated, or not listing them). One ledger is
asked through :class:`VerdictCache`, the other directly; the verdicts, scores and
occupancies must be equal at every step (and so the holds each ledger keeps)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from kit.sizes import at_two_sizes

from gpushare.extender.fit import BINPACK, ContainerNeed, PodNeed, score
from gpushare.extender.ledger import AdmissionLedger, PodFacts
from gpushare.extender.verbs import ExtenderPolicy, Judged, judge_kept, judge_state
from gpushare.extender.verdictcache import VerdictCache
from gpushare.kube import nodestate
from gpushare.share.gputype import CardChoice
from gpushare.share.placement import SPREAD

NODES = ("n0", "n1")
UIDS = ("u0", "u1", "u2", "u3")
TIMEOUT = 30.0


def _key(uid: str, by_name: bool) -> str:
    return f"default/{uid}" if by_name else uid


def _card(node: str, index: int, used: int, pods: Any, truncated: bool) -> nodestate.CardState:
    return nodestate.CardState(
        uuid=f"GPU-{node}-{index}",
        index=index,
        name="Tesla T4" if index else "NVIDIA A100",
        memory_mib=16384,
        memory_units=16,
        memory_units_used=used,
        core_units=100,
        core_units_used=min(100, used * 5),
        healthy=True,
        pods=pods,
        pods_truncated=truncated,
    )


@st.composite
def published(draw: st.DrawFn, node: str) -> nodestate.NodeGpuState:
    """A state of two cards, listing some of the pods (by UID or by name), or none."""
    lists = draw(st.sampled_from(("uid", "name", "none", "truncated")))
    cards = []
    for index in range(2):
        listed = draw(st.lists(st.sampled_from(UIDS), max_size=2, unique=True))
        pods: Any = None
        if lists != "none":
            pods = tuple((_key(uid, lists == "name"), 2, 10) for uid in listed)
        used = min(16, 2 * len(listed) + draw(st.integers(0, 6)))
        cards.append(_card(node, index, used, pods, lists == "truncated" and index == 0))
    generation = draw(st.integers(1, 4))
    return nodestate.NodeGpuState(generation, "2026-11-27T05:00:00Z", 256, tuple(cards))


NEEDS = st.builds(
    lambda sizes: PodNeed(tuple(ContainerNeed(f"c{i}", m, c) for i, (m, c) in enumerate(sizes))),
    st.lists(st.tuples(st.integers(0, 12), st.integers(0, 60)), min_size=1, max_size=2),
)
CHOICES = st.sampled_from((None, CardChoice(use_types=("t4",)), CardChoice(nouse_types=("t4",))))

OPS = st.one_of(
    st.tuples(
        st.just("record"),
        st.sampled_from(UIDS),
        st.sampled_from(NODES),
        st.integers(1, 4),
        st.integers(0, 1),
        st.integers(1, 6),
    ),
    st.tuples(st.just("forget"), st.sampled_from(UIDS)),
    st.tuples(
        st.just("seen"),
        st.sampled_from(UIDS),
        st.sampled_from((*NODES, "")),
        st.integers(0, 8),
        st.sampled_from((False, False, True)),
        st.booleans(),
    ),
    st.tuples(st.just("deleted"), st.sampled_from(UIDS), st.sampled_from((*NODES, ""))),
    st.tuples(st.just("listed"), st.lists(st.sampled_from(UIDS), unique=True)),
    st.tuples(st.just("clock"), st.sampled_from((0.5, 5.0, 20.0, 31.0, 301.0, 700.0))),
    st.tuples(st.just("watching"), st.booleans()),
    st.tuples(st.just("publish"), st.sampled_from(NODES), st.integers(0, 1)),
    st.tuples(st.just("judge"), NEEDS, CHOICES, st.sampled_from(UIDS)),
    st.tuples(st.just("judge"), NEEDS, CHOICES, st.sampled_from(UIDS)),
)


STATES = st.fixed_dictionaries(
    {node: st.lists(published(node), min_size=2, max_size=2) for node in NODES}
)


def _facts(uid: str, node: str, memory: int, ended: bool, planned: bool) -> PodFacts:
    need = PodNeed((ContainerNeed("main", memory, 5),))
    plan = (("main", f"GPU-{node}-1"),) if planned and node else ()
    return PodFacts(uid, f"default/{uid}", node, need, ended, plan)


def _apply(ledger: AdmissionLedger, op: tuple[Any, ...]) -> None:
    kind = op[0]
    if kind == "record":
        _, uid, node, generation, card, memory = op
        ledger.record(uid, node, generation, {f"GPU-{node}-{card}": (memory, 5)}, f"default/{uid}")
    elif kind == "forget":
        ledger.forget_pod(op[1])
    elif kind == "seen":
        ledger.pod_seen(_facts(*op[1:]))
    elif kind == "deleted":
        ledger.pod_deleted(op[1], f"default/{op[1]}", op[2])
    elif kind == "listed":
        ledger.pods_listed(
            _facts(uid, NODES[i % 2], 2, False, False) for i, uid in enumerate(op[1])
        )
    elif kind == "watching":
        ledger.watching = op[1]


@at_two_sizes(
    given(
        st.fixed_dictionaries(
            {node: st.lists(published(node), min_size=2, max_size=2) for node in NODES}
        ),
        st.booleans(),
        st.sampled_from((BINPACK, SPREAD)),
        st.tuples(NEEDS, CHOICES, st.sampled_from(UIDS)),
        st.lists(OPS, max_size=30),
    ),
    quick=60,
    full=300,
    deadline=None,
)
def test_the_cache_answers_as_the_computation(
    states: dict[str, list[nodestate.NodeGpuState]],
    watching: bool,
    placement: str,
    question: tuple[PodNeed, CardChoice | None, str],
    ops: list[tuple[Any, ...]],
) -> None:
    now = [1000.0]
    cached = AdmissionLedger(TIMEOUT, clock=lambda: now[0], max_holds=4)
    direct = AdmissionLedger(TIMEOUT, clock=lambda: now[0], max_holds=4)
    cached.watching = direct.watching = watching
    cache: VerdictCache[Judged] = VerdictCache()
    policy = ExtenderPolicy(placement=placement)
    current = {node: pool[0] for node, pool in states.items()}
    need, choice, other = question
    for op in [("start",), *ops]:
        if op[0] == "start":
            pass
        elif op[0] == "clock":
            now[0] += op[1]
        elif op[0] == "publish":
            current[op[1]] = states[op[1]][op[2]]
        elif op[0] == "judge":
            _, need, choice, other = op
        else:
            _apply(cached, op)
            _apply(direct, op)
        shape = cache.shape((need, choice))
        for node, state in current.items():
            for exclude in ("", other):
                got, judged = judge_kept(
                    node, state, need, policy, cached, exclude, choice, None, cache, shape
                )
                want = judge_state(node, state, need, policy, direct, exclude, choice)
                assert got == want
                assert (judged.verdict if judged else got) == want
                assert score(got.fit, placement) == score(want.fit, placement)
                kept, _memo = cache.occupancy(cached, node, state, placement, exclude)
                assert kept == direct.occupancy(node, state, placement, exclude)
                assert len(cached) == len(direct)
    assert cache.hits  # the cache was used, not only filled


def test_an_unchanged_node_is_answered_from_the_cache() -> None:
    """The cache is used: a node asked again with nothing changed is not recomputed, and
    a hold recorded there is counted at once."""
    state = nodestate.NodeGpuState(
        1, "2026-11-27T05:00:00Z", 256, (_card("n0", 0, 4, (("u0", 4, 20),), False),)
    )
    ledger = AdmissionLedger(TIMEOUT)
    ledger.watching = True
    cache: VerdictCache[Judged] = VerdictCache()
    need = PodNeed((ContainerNeed("main", 8, 10),))
    policy = ExtenderPolicy()
    shape = cache.shape((need, None))
    first, _ = judge_kept("n0", state, need, policy, ledger, "", None, None, cache, shape)
    again, _ = judge_kept("n0", state, need, policy, ledger, "", None, None, cache, shape)
    assert (cache.misses, cache.hits) == (1, 1)
    assert again is first and first.fit.fits
    ledger.record("u9", "n0", 1, {"GPU-n0-0": (8, 10)})
    after, _ = judge_kept("n0", state, need, policy, ledger, "", None, None, cache, shape)
    assert cache.misses == 2
    assert not after.fit.fits and after.code == "held"
