"""Every card a DRA container sees has its own memory limit (issue 32 item 2).

HAMi-core limits device ``i`` of the container by ``CUDA_DEVICE_MEMORY_LIMIT_<i>``, else
by ``CUDA_DEVICE_MEMORY_LIMIT`` (its ``do_init_device_memory_limits``), else not at all;
``i`` is the index the card has inside the container (NVML's order: the node's, restricted
to the cards the container sees). A claim's results are separate CDI devices whose edits
the runtime applies in turn, a later one replacing an earlier one's variable of the same
name. Before the fix each result wrote only ``CUDA_DEVICE_MEMORY_LIMIT_0``: on a claim of
two cards the second card ran unlimited (a card charged 1024 MiB usable to its whole
memory). Here the real prepare, over real sockets, and the container's env as the CDI
library would build it, in every order the runtime might apply the devices.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from kit.cdi_runtime import create_runtime_hooks
from kit.memhook import HAVE_GCC
from test_dra_plugin import NODE, DraNode, dra, env_of

from gpushare.sim.apidouble import KubeApiDouble
from gpushare.sim.drakubeletdouble import pod_using_claims

__all__ = ["dra"]  # fixture

MIB = 1 << 20


def _apply(devices: list[dict[str, Any]]) -> dict[str, str]:
    """The container's env after these CDI devices, in this order (env replaced by name)."""
    env: dict[str, str] = {}
    for device in devices:
        for entry in device["containerEdits"].get("env", []):
            name, value = entry.split("=", 1)
            env[name] = value
    return env


def _hami_limit(env: dict[str, str], index: int) -> int:
    """HAMi-core's limit of device ``index`` in bytes (0: none), from its source."""

    def parse(value: str | None) -> int:
        if not value:
            return 0
        scale = {"g": 1 << 30, "m": 1 << 20, "k": 1 << 10}.get(value[-1].lower(), 1)
        return int(value[:-1] if scale != 1 else value) * scale

    return parse(env.get(f"CUDA_DEVICE_MEMORY_LIMIT_{index}")) or parse(
        env.get("CUDA_DEVICE_MEMORY_LIMIT")
    )


def _check_every_order(specs: list[dict[str, Any]], grants: dict[str, int]) -> None:
    """``grants``: card UUID -> the MiB it was charged. Every card the container sees, by
    its index in the node's order, is limited, to no more than it was charged."""
    devices = [d for spec in specs for d in spec["devices"]]
    cards = sorted(grants)  # GPU-00000000 < GPU-00000001: the node's order
    for order in itertools.permutations(devices):
        env = _apply(list(order))
        for index, uuid in enumerate(cards):
            limit = _hami_limit(env, index)
            assert 0 < limit <= grants[uuid] * MIB, (index, uuid, env)
        if "," in env.get("NVIDIA_VISIBLE_DEVICES", "") or len(specs) == 1:
            assert env["NVIDIA_VISIBLE_DEVICES"].split(",") == cards


@pytest.fixture
def node(dra: DraNode) -> DraNode:
    """The DRA node of ``test_dra_plugin``'s ``dra``, started (``dra`` stops it)."""
    dra.start()
    return dra


def test_a_claim_on_two_cards_limits_both(node: DraNode) -> None:
    ref = node.claim(
        "two-cards",
        {"request": "a", "device": "gpu-0", "consumedCapacity": {"memory": "1Gi"}},
        {"request": "b", "device": "gpu-1", "consumedCapacity": {"memory": "4Gi"}},
    )
    (answer,) = node.kubelet.prepare([ref]).values()
    assert answer.error == ""
    spec = node.spec(ref[2])
    _check_every_order([spec], {"GPU-00000000": 1024, "GPU-00000001": 4096})


def _pod(node: DraNode, name: str, containers: dict[str, list[str]], **kw: Any) -> str:
    """A pod of the node whose containers use these claims; its UID."""
    obj = node.api.add(pod_using_claims("default", name, NODE, containers, **kw))
    return str(obj["metadata"]["uid"])


def _reserve(node: DraNode, claim: str, *pods: tuple[str, str]) -> None:
    """Reserve the claim for these pods too, as the scheduler does before binding one."""
    obj = node.api.get("ResourceClaim", claim, "default", "resource.k8s.io/v1")
    assert obj is not None
    reserved = obj["status"].setdefault("reservedFor", [])
    reserved += [{"resource": "pods", "name": n, "uid": u} for n, u in pods]
    node.api.add(obj)


def _one_card(node: DraNode, name: str, device: str, memory: str, *pods: tuple[str, str]) -> Any:
    ref = node.claim(
        name, {"request": "r", "device": device, "consumedCapacity": {"memory": memory}}
    )
    _reserve(node, name, *pods)
    return ref


def test_two_one_card_claims_in_one_container_are_held_to_the_smaller(node: DraNode) -> None:
    """Before: each claim set every index to its own share, and whichever the runtime
    applied last decided for both cards: the 1 GiB card usable to 4 GiB in half the
    orders. Now both are held to the smaller share, read from the pod's spec."""
    uid = _pod(node, "both", {"main": ["small", "large"]})
    refs = [
        _one_card(node, "small", "gpu-0", "1Gi", ("both", uid)),
        _one_card(node, "large", "gpu-1", "4Gi", ("both", uid)),
    ]
    answers = node.kubelet.prepare(refs)
    assert [a.error for a in answers.values()] == ["", ""]
    _check_every_order(
        [node.spec(r[2]) for r in refs], {"GPU-00000000": 1024, "GPU-00000001": 4096}
    )
    # the same claims in separate calls (the kubelet retrying one of them): the same
    for ref in refs:
        node.kubelet.unprepare([ref])
    for ref in reversed(refs):
        assert next(iter(node.kubelet.prepare([ref]).values())).error == ""
    _check_every_order(
        [node.spec(r[2]) for r in refs], {"GPU-00000000": 1024, "GPU-00000001": 4096}
    )


def test_a_claim_used_alone_by_one_pod_and_with_another_by_a_second_is_held(
    node: DraNode,
) -> None:
    """A shared claim reserved for two pods: its limit is the smallest of every container
    that uses it, in either pod; the claims it never shares a container with are not."""
    alone = _pod(node, "alone", {"main": ["shared"]})
    mixed = _pod(node, "mixed", {"main": ["shared", "small"], "side": ["other"]})
    shared = _one_card(node, "shared", "gpu-1", "8Gi", ("alone", alone), ("mixed", mixed))
    small = _one_card(node, "small", "gpu-0", "2Gi", ("mixed", mixed))
    other = _one_card(node, "other", "gpu-0", "6Gi", ("mixed", mixed))
    assert next(iter(node.kubelet.prepare([shared]).values())).error == ""
    assert all(a.error == "" for a in node.kubelet.prepare([small, other]).values())
    assert env_of(node.spec(shared[2]))["CUDA_DEVICE_MEMORY_LIMIT"] == "2048m"
    assert env_of(node.spec(other[2]))["CUDA_DEVICE_MEMORY_LIMIT"] == "6144m"
    _check_every_order(
        [node.spec(shared[2]), node.spec(small[2])], {"GPU-00000000": 2048, "GPU-00000001": 8192}
    )


def test_a_mate_prepared_before_with_a_larger_limit_refuses_the_claim(node: DraNode) -> None:
    """A claim prepared for one pod before a second pod used it beside a smaller claim:
    its spec already sets the larger share, which the runtime may apply to the smaller
    claim's card. The smaller claim is refused, with the reason, until that one goes."""
    first = _pod(node, "first", {"main": ["big"]})
    big = _one_card(node, "big", "gpu-1", "8Gi", ("first", first))
    assert next(iter(node.kubelet.prepare([big]).values())).error == ""
    later = _pod(node, "later", {"main": ["big", "tiny"]})
    _reserve(node, "big", ("later", later))
    tiny = _one_card(node, "tiny", "gpu-0", "1Gi", ("later", later))
    (answer,) = node.kubelet.prepare([tiny]).values()
    assert "container main of pod default/later also uses claim big" in answer.error
    assert "8192 MiB" in answer.error and "1024 MiB" in answer.error
    assert not (node.cdi / f"gpu.gpushare.io-claim_{tiny[2]}.json").exists()
    node.kubelet.unprepare([big])
    (answer,) = node.kubelet.prepare([tiny]).values()
    assert answer.error == ""


def _created(node: DraNode, refs: list[Any]) -> list[str]:
    """The container that uses these claims, as the runtime creates it in every order it
    may apply their CDI devices: per distinct final env, "" when every createRuntime hook
    let it through, else the failing hook's one line."""
    devices = [d for r in refs for d in node.spec(r[2])["devices"]]
    envs = {tuple(sorted(_apply(list(o)).items())) for o in itertools.permutations(devices)}
    verdicts = []
    for env in sorted(envs):
        results = create_runtime_hooks(devices, dict(env), node.root / "bundle")
        failed = [r for r in results if r.returncode != 0]
        verdicts.append(failed[0].stderr.strip() if failed else "")
    return verdicts


@pytest.mark.skipif(not HAVE_GCC, reason="needs gcc (the limit check is C)")
def test_a_container_of_claims_all_prepared_for_other_pods_is_refused_by_the_check(
    node: DraNode,
) -> None:
    """The case prepare cannot see (docs/security.md row 32.2): two shared claims of
    unequal shares, each prepared for a pod of its own, then both used by one container of
    a third pod. The kubelet does not call the driver for a claim already prepared, so
    nothing is refused at prepare; the runtime applies both specs, and whichever comes
    last, the smaller claim's limit check sees the larger share and the container is not
    created. Claims of equal shares start in every order."""
    own_small = _pod(node, "own-small", {"main": ["small"]})
    own_big = _pod(node, "own-big", {"main": ["big"]})
    small = _one_card(node, "small", "gpu-0", "1Gi", ("own-small", own_small))
    big = _one_card(node, "big", "gpu-1", "4Gi", ("own-big", own_big))
    same = _one_card(node, "same", "gpu-1", "1Gi", ("own-big", own_big))
    for ref in (small, big, same):
        assert next(iter(node.kubelet.prepare([ref]).values())).error == ""
    both = _pod(node, "both", {"main": ["small", "big"]})
    _reserve(node, "small", ("both", both))
    _reserve(node, "big", ("both", both))
    verdicts = _created(node, [small, big])
    assert len(verdicts) == 2  # the one order where the small claim came last starts
    assert "" in verdicts
    (refused,) = [v for v in verdicts if v]
    assert refused.startswith("gpushare-memory-hook: CUDA_DEVICE_MEMORY_LIMIT")
    assert "=4096m is above this claim's share (1024 MiB)" in refused
    # ... and the order that starts is within every card's charge
    devices = [node.spec(r[2])["devices"][0] for r in (big, small)]
    assert _hami_limit(_apply(devices), 0) == _hami_limit(_apply(devices), 1) == 1024 * MIB
    assert set(_created(node, [small, same])) == {""}  # equal shares: every order starts


def test_without_the_limit_check_a_share_is_refused_at_prepare(
    short_tmp: Path, api: KubeApiDouble
) -> None:
    """Where the hook could not be installed, a claim share the interposer would hold is
    refused with the reason, before anything is made for it (fail closed)."""
    dra = DraNode(short_tmp, api)
    dra.enforcement = replace(dra.enforcement, limit_check=None)
    dra.start()
    try:
        ref = dra.claim(
            "unchecked", {"request": "r", "device": "gpu-0", "consumedCapacity": {"memory": "1Gi"}}
        )
        (answer,) = dra.kubelet.prepare([ref]).values()
        assert "the limit check (the memory hook, --memory-hook) is not installed" in answer.error
        assert not (dra.cdi / f"gpu.gpushare.io-claim_{ref[2]}.json").exists()
        assert not list((dra.host / "containers").glob("d-*"))
    finally:
        dra.stop()


def test_a_claim_prepared_from_a_read_older_than_a_pod_keeps_its_mates_record(
    node: DraNode,
) -> None:
    """Two pods' calls racing: the small claim is prepared for the second pod (whose
    container uses the big one too) while the big claim's prepare for the first pod
    works from a read made before the second pod reserved it. The big claim cannot see
    that container, but the small claim recorded the smallest share there, and the big
    one is held to it (before: 8 GiB on the 1 GiB card in half the orders)."""
    first = _pod(node, "early", {"main": ["big"]})
    second = _pod(node, "joined", {"main": ["big", "small"]})
    big = _one_card(node, "big", "gpu-1", "8Gi", ("early", first))  # the stale read
    small = _one_card(node, "small", "gpu-0", "1Gi", ("joined", second))
    assert next(iter(node.kubelet.prepare([small]).values())).error == ""
    assert next(iter(node.kubelet.prepare([big]).values())).error == ""
    assert env_of(node.spec(big[2]))["CUDA_DEVICE_MEMORY_LIMIT"] == "1024m"
    _check_every_order(
        [node.spec(big[2]), node.spec(small[2])], {"GPU-00000000": 1024, "GPU-00000001": 8192}
    )
    node.kubelet.unprepare([small, big])  # the record goes with the small claim
    assert next(iter(node.kubelet.prepare([big]).values())).error == ""
    assert env_of(node.spec(big[2]))["CUDA_DEVICE_MEMORY_LIMIT"] == "8192m"


def test_a_pod_that_cannot_be_read_refuses_the_claim_and_a_gone_pod_is_skipped(
    node: DraNode,
) -> None:
    uid = _pod(node, "reader", {"main": ["lone"]})
    lone = _one_card(node, "lone", "gpu-0", "2Gi", ("reader", uid))
    node.api.fail_next(1, 500, path_part="/pods/reader")
    (answer,) = node.kubelet.prepare([lone]).values()
    assert answer.error.startswith("claim default/lone: cannot read pod default/reader")
    assert not (node.cdi / f"gpu.gpushare.io-claim_{lone[2]}.json").exists()
    (answer,) = node.kubelet.prepare([lone]).values()  # the kubelet's retry
    assert answer.error == ""
    gone = _one_card(node, "orphan", "gpu-0", "2Gi", ("deleted", "uid-of-a-pod-gone"))
    (answer,) = node.kubelet.prepare([gone]).values()
    assert answer.error == ""
    odd = _one_card(node, "odd", "gpu-0", "2Gi", ("../../../api/v1/nodes/x", "u"))
    (answer,) = node.kubelet.prepare([odd]).values()
    assert "reserved for pod '../../../api/v1/nodes/x' is not a valid name" in answer.error
    assert node.api.calls("GET", "/nodes/x") == []


def test_a_template_claim_not_created_yet_refuses_and_a_created_one_is_found(
    node: DraNode,
) -> None:
    """A pod claim from a template is named in the pod's status by the resourceclaim
    controller; before that, which claims share the container cannot be told."""
    pod = pod_using_claims(
        "default", "tmpl", NODE, {"main": ["gen-1", "small"]}, templates={"gen-1": "scratch"}
    )
    pod["status"]["resourceClaimStatuses"] = []
    uid = str(node.api.add(pod)["metadata"]["uid"])
    small = _one_card(node, "small", "gpu-0", "1Gi", ("tmpl", uid))
    gen = _one_card(node, "gen-1", "gpu-1", "4Gi", ("tmpl", uid))
    answers = node.kubelet.prepare([small, gen])
    assert all("pod claim 'scratch' has no ResourceClaim yet" in a.error for a in answers.values())
    node.api.add(
        pod_using_claims(
            "default", "tmpl", NODE, {"main": ["gen-1", "small"]}, templates={"gen-1": "scratch"}
        )
        | {"metadata": {"name": "tmpl", "namespace": "default", "uid": uid}}
    )
    answers = node.kubelet.prepare([small, gen])
    assert [a.error for a in answers.values()] == ["", ""]
    assert env_of(node.spec(gen[2]))["CUDA_DEVICE_MEMORY_LIMIT"] == "1024m"


_SHARE = st.tuples(st.sampled_from(["gpu-0", "gpu-1"]), st.integers(1, 96), st.integers(0, 100))
_NAMES = itertools.count()


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(shares=st.lists(_SHARE, min_size=1, max_size=3))
def test_any_claim_limits_every_card_it_shows_to_at_most_its_charge(
    node: DraNode, shares: list[tuple[str, int, int]]
) -> None:
    results = [
        {
            "request": f"r{i}",
            "device": device,
            "consumedCapacity": {"memory": f"{units * 256}Mi", "cores": str(cores)},
        }
        for i, (device, units, cores) in enumerate(shares)
    ]
    ref = node.claim(f"c{next(_NAMES)}", *results)
    (answer,) = node.kubelet.prepare([ref]).values()
    assert answer.error == ""
    charged: dict[str, int] = {}
    for device, units, _cores in shares:
        uuid = f"GPU-0000000{device[-1]}"
        charged[uuid] = min(charged.get(uuid, units * 256), units * 256)
    spec = node.spec(ref[2])
    _check_every_order([spec], charged)
    env = _apply(spec["devices"])
    smallest = min(c or 100 for _d, _u, c in shares)
    assert env.get("CUDA_DEVICE_SM_LIMIT", "100") == str(smallest)


# ---------------------------------------------------------------- pods, claims, orders
_RESULTS = st.lists(
    st.tuples(
        st.sampled_from(["gpu-0", "gpu-1"]),
        st.integers(1, 96),
        st.sampled_from([0, 10, 30, 55, 100]),
    ),
    min_size=1,
    max_size=2,
)


@st.composite
def _worlds(draw: st.DrawFn, late: bool) -> dict[str, Any]:
    """1-3 claims of 1-2 shares; 1-2 pods (2 when ``late``) of 1-3 containers, each
    using any of them; the pods reserved before any prepare, or (``late``) each as it
    arrives, after the pods before it had their claims prepared; each pod's claims sent
    in any order, split in separate calls anyhow."""
    claims = draw(st.lists(_RESULTS, min_size=2 if late else 1, max_size=3))
    n = len(claims)

    def containers(among: int) -> st.SearchStrategy[list[list[int]]]:
        uses = st.lists(st.integers(0, among - 1), unique=True, min_size=1)
        return st.lists(uses, min_size=1, max_size=3)

    if not late:
        pods = draw(st.lists(containers(n), min_size=1, max_size=2))
    else:  # the second pod's first container: a claim of the first pod's, and a new one
        first = draw(containers(n - 1))
        mate = draw(st.sampled_from(sorted({j for c in first for j in c})))
        pods = [first, [[n - 1, mate], *draw(containers(n))[:2]]]
    calls = []
    for containers in pods:
        used = sorted({j for c in containers for j in c})
        order = draw(st.permutations(used))
        cuts = draw(st.lists(st.booleans(), min_size=len(order), max_size=len(order)))
        calls.append((order, cuts))
    return {"claims": claims, "pods": pods, "calls": calls, "late": late}


def _container_safe(
    node: DraNode, shares: list[list[tuple[str, int, int]]], refs: list[Any], used: list[int]
) -> bool:
    """In every order the runtime may apply the container's CDI devices, every card it
    sees (by its index in the node's order) has a memory limit, none above the smallest
    share it holds of that card, and a core limit no higher than the smallest core share."""
    memory: dict[str, int] = {}
    cores: dict[str, int] = {}
    for j in used:
        for device, units, share_cores in shares[j]:
            uuid = f"GPU-0000000{device[-1]}"
            memory[uuid] = min(memory.get(uuid, units * 256), units * 256)
            cores[uuid] = min(cores.get(uuid, 100), share_cores or 100)
    devices = [d for j in used for d in node.spec(refs[j][2])["devices"]]
    for order in itertools.permutations(devices):
        env = _apply(list(order))
        for index, uuid in enumerate(sorted(memory)):
            limit = _hami_limit(env, index)
            if not 0 < limit <= memory[uuid] * MIB:
                return False
            if int(env.get("CUDA_DEVICE_SM_LIMIT", "100")) > cores[uuid]:
                return False
    return True


_EXAMPLES = settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_EXAMPLES
@given(world=_worlds(late=False))
def test_no_card_of_any_container_runs_above_its_charge(
    node: DraNode, world: dict[str, Any]
) -> None:
    """Pods with 1-3 containers using any of 1-3 claims of 1-2 shares, a claim shared by
    two pods, prepared in any calls the kubelet may make, the CDI devices applied in any
    order. Every pod is reserved before its claims are prepared (the scheduler binds a
    pod after reserving all its claims, and the kubelet prepares a claim only for a pod
    it is reserved for): nothing is refused, and no card of any container is unlimited
    or limited above its charge."""
    _run(node, world)


@_EXAMPLES
@given(world=_worlds(late=True))
def test_a_pod_joining_prepared_claims_is_refused_or_within_its_charge(
    node: DraNode, world: dict[str, Any]
) -> None:
    """The second pod reserves claims after they were prepared for the first. It may be
    refused at prepare (the reason names the mate prepared before); a container of it
    whose claims were all prepared before the pod reserved them (the kubelet never asks
    the driver) is refused by the claims' limit checks when the runtime creates it with
    any card above its charge, and any container the checks let through is within every
    charge (docs/security.md, row 32.2)."""
    _run(node, world)


def _run(node: DraNode, world: dict[str, Any]) -> None:
    tag = next(_NAMES)
    shares: list[list[tuple[str, int, int]]] = world["claims"]
    pods: list[list[list[int]]] = world["pods"]
    names = [f"w{tag}-c{j}" for j in range(len(shares))]
    uids = [
        _pod(node, f"w{tag}-p{i}", {f"k{k}": [names[j] for j in c] for k, c in enumerate(pod)})
        for i, pod in enumerate(pods)
    ]
    refs = [
        node.claim(
            names[j],
            *[
                {
                    "request": f"r{r}",
                    "device": device,
                    "consumedCapacity": {"memory": f"{units * 256}Mi", "cores": str(cores)},
                }
                for r, (device, units, cores) in enumerate(results)
            ],
        )
        for j, results in enumerate(shares)
    ]

    def reserve(i: int) -> None:
        for j in sorted({j for c in pods[i] for j in c}):
            _reserve(node, names[j], (f"w{tag}-p{i}", uids[i]))

    if not world["late"]:
        for i in range(len(pods)):
            reserve(i)
    prepared: set[int] = set()
    asked: list[set[int]] = []
    errors: list[str] = []
    for i, (order, cuts) in enumerate(world["calls"]):
        if world["late"]:
            reserve(i)
        todo = [j for j in order if j not in prepared]
        asked.append(set(todo))
        batches: list[list[int]] = []
        for j, cut in zip(todo, cuts, strict=False):
            if cut or not batches:
                batches.append([])
            batches[-1].append(j)
        for batch in batches:
            answers = node.kubelet.prepare([refs[j] for j in batch])
            for j in batch:
                error = answers[refs[j][2]].error
                if error:
                    errors.append(error)
                else:
                    prepared.add(j)
    try:
        if not world["late"]:
            assert errors == []
        for error in errors:
            assert "prepared before with limits of" in error, error
        for i, pod in enumerate(pods):
            if not all(j in prepared for c in pod for j in c):
                continue  # not started: a claim of it was refused
            for used in pod:
                if not used:
                    continue
                if HAVE_GCC:  # the runtime runs the claims' limit checks
                    verdicts = _created(node, [refs[j] for j in used])
                    if all(v == "" for v in verdicts):
                        assert _container_safe(node, shares, refs, used)
                        continue
                    # refused: only where the driver is never asked about the container
                    assert world["late"] and len(used) > 1 and not asked[i] & set(used)
                    assert all("is above this claim's share" in v for v in verdicts if v)
                    event("a container of claims all prepared before its pod: refused")
                elif not _container_safe(node, shares, refs, used):
                    assert world["late"] and len(used) > 1 and not asked[i] & set(used)
        event(f"refused: {len(errors)}")
    finally:
        node.kubelet.unprepare([refs[j] for j in sorted(prepared)])
