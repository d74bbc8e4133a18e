"""Which claims a pod's containers use together, and what a prepared claim's spec sets
(:mod:`gpushare.dra.mates`): pure reads of plain objects."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushare.dra.checkpoint import PREPARED, RECOVERED, ClaimEntry, PreparedDevice
from gpushare.dra.mates import (
    MAX_RESERVED_FOR,
    Container,
    Mate,
    MatesUnknown,
    Shares,
    Together,
    applied_limits,
    claims_by_container,
    overreaching,
    promised,
    reserving_pods,
)
from gpushare.sim.drakubeletdouble import pod_using_claims


def test_containers_and_init_containers_name_their_claims_through_the_pod() -> None:
    pod = pod_using_claims(
        "ns", "p", "node", {"a": ["one", "two"], "b": ["two"]}, templates={"two": "gen"}
    )
    pod["spec"]["initContainers"] = [
        {"name": "setup", "resources": {"claims": [{"name": "pc-one", "request": "r0"}]}}
    ]
    pod["spec"]["containers"].append({"name": "plain", "image": "x"})
    assert claims_by_container(pod) == {
        "a": frozenset({"one", "two"}),
        "b": frozenset({"two"}),
        "setup": frozenset({"one"}),  # one request of a claim: the whole claim counts
    }


def test_a_template_that_asked_no_claim_is_none_and_one_not_created_is_unknown() -> None:
    pod = pod_using_claims("ns", "p", "node", {"a": ["one", "two"]}, templates={"two": "gen"})
    pod["status"]["resourceClaimStatuses"] = [{"name": "gen", "resourceClaimName": None}]
    assert claims_by_container(pod) == {"a": frozenset({"one"})}
    pod["status"]["resourceClaimStatuses"] = []
    with pytest.raises(MatesUnknown, match="'gen' has no ResourceClaim yet"):
        claims_by_container(pod)


def test_an_extended_resource_claim_counts_for_the_containers_it_serves() -> None:
    pod = pod_using_claims("ns", "p", "node", {"a": ["one"]})
    pod["spec"]["containers"].append({"name": "legacy", "image": "x"})
    pod["status"]["extendedResourceClaimStatus"] = {
        "resourceClaimName": "p-extended",
        "requestMappings": [
            {"containerName": "legacy", "resourceName": "gpushare.io/gpu", "requestName": "c"},
            {"containerName": "a", "resourceName": "gpushare.io/gpu", "requestName": "c"},
        ],
    }
    assert claims_by_container(pod) == {
        "a": frozenset({"one", "p-extended"}),
        "legacy": frozenset({"p-extended"}),
    }


@given(
    st.recursive(
        st.none() | st.integers() | st.text(max_size=3),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "spec",
                        "status",
                        "containers",
                        "resources",
                        "claims",
                        "name",
                        "resourceClaims",
                        "resourceClaimName",
                        "resourceClaimStatuses",
                        "initContainers",
                    ]
                ),
                inner,
                max_size=4,
            )
        ),
        max_leaves=20,
    )
)
def test_any_pod_object_gives_an_answer_or_says_it_cannot(pod: Any) -> None:
    """What the API server sends is read, never trusted: an answer or MatesUnknown."""
    if not isinstance(pod, dict):
        pod = {"spec": pod}
    try:
        found = claims_by_container(pod)
    except MatesUnknown:
        return
    assert all(isinstance(v, frozenset) and v for v in found.values())


def test_only_pods_are_read_from_reserved_for_and_the_api_cap_holds() -> None:
    claim: dict[str, Any] = {
        "status": {
            "reservedFor": [
                {"resource": "pods", "name": "p", "uid": "u1"},
                {"resource": "widgets", "apiGroup": "example.com", "name": "w", "uid": "u2"},
            ]
        }
    }
    assert reserving_pods(claim) == [("p", "u1")]
    claim["status"]["reservedFor"] = [{"resource": "pods", "name": "p", "uid": "u"}] * (
        MAX_RESERVED_FOR + 1
    )
    with pytest.raises(MatesUnknown, match="more than 256"):
        reserving_pods(claim)


def _device(memory: int | None, cores: int | None = None, mig: str = "") -> PreparedDevice:
    return PreparedDevice("r", "pool", "gpu-0", ["x"], memory_mib=memory, cores=cores, mig=mig)


def test_what_a_prepared_spec_sets_is_recorded_or_bounded_from_above() -> None:
    recorded = ClaimEntry("ns", "c", PREPARED, "c", memory_limit_mib=1024, core_limit=30)
    assert applied_limits(recorded, 100) == Shares(1024, 30)
    # an entry of before: its shares' largest values bound what it set
    older = ClaimEntry("ns", "c", PREPARED, "c", devices=[_device(1024, 0), _device(4096, 30)])
    assert applied_limits(older, 100) == Shares(4096, 100)
    # a value not known counts as the largest possible; whole and MIG devices set none
    unknown = ClaimEntry("unknown", "u", RECOVERED, "u", devices=[_device(None)])
    assert applied_limits(unknown, 100) == Shares(1 << 40, 100)
    whole = ClaimEntry("ns", "c", PREPARED, "c", devices=[_device(40960, mig="MIG-1")])
    assert applied_limits(whole, 100) is None


_SHARE = st.builds(Shares, st.integers(1, 9), st.integers(1, 100))


@given(
    st.lists(st.lists(st.tuples(st.integers(0, 3), _SHARE | st.none()), max_size=3), max_size=3),
    st.dictionaries(st.integers(0, 3), _SHARE),
)
def test_a_claim_holding_its_floor_passes_the_check_exactly_when_its_mates_do(
    containers: list[list[tuple[int, Shares | None]]], applied: dict[int, Shares]
) -> None:
    """Claim 0 is this one. The check refuses exactly when a prepared mate sets more than
    the smallest share of a container they share; the floors recorded hold every mate."""
    together = Together(
        tuple(
            Container(
                "ns/p", f"c{k}", (Mate("c0", "0", None), *(Mate(f"c{j}", str(j), s) for j, s in c))
            )
            for k, c in enumerate(containers)
        )
    )
    sets = {str(j): s for j, s in applied.items() if j != 0}
    why = overreaching(together, "0", sets.get)
    over = any(
        m.uid in sets and c.floor() is not None and not sets[m.uid].within(c.floor())  # type: ignore[arg-type]
        for c in together.containers
        for m in c.mates
        if m.uid != "0"
    )
    assert bool(why) == over
    entry = ClaimEntry("ns", "c0", PREPARED, "0", held_with=together.floors("0"))
    for c, m in itertools.product(together.containers, range(1, 4)):
        floor = c.floor()
        if floor is not None and str(m) in {x.uid for x in c.mates}:
            held = promised([entry], str(m))
            assert held is not None and held.within(floor)
