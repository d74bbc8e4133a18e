"""gpushare.dra.claimread: a claim's reference is checked before any read, only this
driver's results count and one of another node's pool refuses the claim, a claim
deleted and created again (another UID) is refused, and every share of a claim is held
to its smallest memory and core share (and to its mates')."""

from __future__ import annotations

from typing import Any

import pytest

from gpushare.dra.claimread import (
    ClaimRef,
    ClaimRefused,
    check_ref,
    claim_limits,
    claim_path,
    claim_shares,
    results_of,
)
from gpushare.dra.mates import Shares
from gpushare.dra.model import API_VERSION, Offered

DRIVER, POOL = "gpu.example.com", "node-1"
REF = ClaimRef("team-a", "train", "uid-1")
OFFERED = {
    f"gpu-{i}": Offered(f"gpu-{i}", f"GPU-{i}", 16384, True, i, 16384, f"GPU-{i}") for i in range(2)
}


def result(device: str, memory: str | None = None, cores: str | None = None, **over: Any) -> dict:
    consumed = {k: v for k, v in (("memory", memory), ("cores", cores)) if v is not None}
    return {"driver": DRIVER, "pool": POOL, "device": device, "request": "r",
            **({"consumedCapacity": consumed} if consumed else {}), **over}  # fmt: skip


def claim(uid: str, *results: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "team-a", "name": "train", "uid": uid},
        "status": {"allocation": {"devices": {"results": list(results)}}},
    }


def test_the_path_is_the_claims_own() -> None:
    assert claim_path("ns", "c") == f"/apis/{API_VERSION}/namespaces/ns/resourceclaims/c"


@pytest.mark.parametrize(
    "ref",
    [
        ClaimRef("Team", "c", "u"),
        ClaimRef("ns", "c/../x", "u"),
        ClaimRef("ns", "c", "u/1"),
        ClaimRef("a" * 64, "c", "u"),
        ClaimRef("ns", "", "u"),
    ],
)
def test_a_malformed_reference_is_refused_before_any_read(ref: ClaimRef) -> None:
    with pytest.raises(ClaimRefused):
        check_ref(ref)


def test_a_well_formed_reference_passes() -> None:
    check_ref(REF)
    check_ref(ClaimRef("kube-system", "a.b-c", "0f3c-9a"))


def test_only_this_drivers_results_count() -> None:
    other = {"driver": "other.example.com", "pool": "x", "device": "d"}
    mine = result("gpu-0", "4Gi")
    assert results_of(REF, claim("uid-1", other, mine), DRIVER, POOL) == [mine]


def test_another_uid_another_pool_or_no_allocation_is_refused() -> None:
    with pytest.raises(ClaimRefused, match="deleted and created again"):
        results_of(REF, claim("uid-2", result("gpu-0")), DRIVER, POOL)
    with pytest.raises(ClaimRefused, match="not of this node"):
        results_of(REF, claim("uid-1", result("gpu-0", pool="node-2")), DRIVER, POOL)
    with pytest.raises(ClaimRefused, match="not allocated"):
        results_of(REF, {"metadata": {"uid": "uid-1"}, "status": {}}, DRIVER, POOL)


def plan(*results: dict[str, Any]) -> list[tuple[str, Offered, dict[str, Any]]]:
    return [("r", OFFERED[r["device"]], r) for r in results]


def test_every_share_is_held_to_the_smallest_of_the_claim() -> None:
    limits = claim_limits(
        REF, plan(result("gpu-1", "4Gi", "30"), result("gpu-0", "2Gi", "50")), 256
    )
    assert (limits.memory_mib, limits.cores) == (2048, 30)
    assert limits.cards == ("GPU-0", "GPU-1")  # the node's order
    assert limits.charged == (2048, 30)


def test_no_core_share_means_no_core_limit_and_mates_lower_the_limits() -> None:
    alone = claim_limits(REF, plan(result("gpu-0", "4Gi")), 256)
    assert (alone.memory_mib, alone.cores, alone.cards) == (4096, None, ())
    held = claim_limits(REF, plan(result("gpu-0", "4Gi")), 256, hold=Shares(1024, 20))
    assert (held.memory_mib, held.cores) == (1024, 20)
    assert held.charged == (4096, None)  # what the claim itself was charged


def test_a_share_the_card_cannot_hold_refuses_the_claim() -> None:
    with pytest.raises(ClaimRefused, match="gpu-0"):
        claim_limits(REF, plan(result("gpu-0", "17Gi")), 256)


def test_a_mates_shares_are_read_from_its_object_and_none_when_it_has_none() -> None:
    found = claim("uid-9", result("gpu-0", "3Gi", "25"), result("gpu-1", "5Gi"))
    assert claim_shares(found, DRIVER, POOL, OFFERED, 256) == Shares(3072, 25)
    elsewhere = claim("uid-9", result("gpu-0", "3Gi", pool="node-2"))
    assert claim_shares(elsewhere, DRIVER, POOL, OFFERED, 256) is None
    unreadable = claim("uid-9", result("gpu-0", "lots"))
    assert claim_shares(unreadable, DRIVER, POOL, OFFERED, 256) is None
