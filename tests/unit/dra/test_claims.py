"""gpushare.dra.claims: the claim preparer called directly, as the DRA server calls it
(without the gRPC door in between): a share is prepared into a CDI spec and a
checkpoint entry, prepared again it answers the same, one claim's refusal leaves the
others prepared, and unprepare removes what prepare made; which shares get a directory
of their own (``host.grants.share_needs``, as the DRA door asks it) follows the card's
backends."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_dra_plugin import DRIVER, DraNode

from gpushare.dra.claimread import ClaimRef
from gpushare.dra.claims import ClaimPreparer
from gpushare.host.grants import NodeDirs, share_needs
from gpushare.share.answers import Enforcement
from gpushare.sim.apidouble import KubeApiDouble


@pytest.fixture
def preparer(short_tmp: Path, api: KubeApiDouble) -> Iterator[tuple[DraNode, ClaimPreparer]]:
    node = DraNode(short_tmp, api)
    part = node.build()
    part.preparer.tidy()  # what the part's start does first
    try:
        yield node, part.preparer
    finally:
        part.preparer.lock.close()


def test_a_share_is_prepared_once_answered_again_and_unprepared(
    preparer: tuple[DraNode, ClaimPreparer],
) -> None:
    node, claims = preparer
    ns, name, uid = node.claim(
        "share", {"request": "r", "device": "gpu-1", "consumedCapacity": {"memory": "2Gi"}}
    )
    ref = ClaimRef(ns, name, uid)
    first = claims.prepare([ref])[uid]
    assert first.error == ""
    (device,) = first.devices
    assert device.memory_mib == 2048 and device.card == "GPU-00000001"
    spec = node.cdi / f"{DRIVER}-claim_{uid}.json"
    assert spec.is_file()
    assert [e.name for e in claims.held.entries()] == ["share"]
    assert claims.prepare([ref])[uid] == first  # the kubelet may ask twice
    assert claims.unprepare([ref]) == {uid: ""}
    assert not spec.exists() and claims.held.entries() == []
    assert claims.unprepare([ref]) == {uid: ""}  # done already: done


def test_one_claims_refusal_leaves_the_others_prepared(
    preparer: tuple[DraNode, ClaimPreparer],
) -> None:
    node, claims = preparer
    good = ClaimRef(*node.claim("good", {"request": "r", "device": "gpu-0"}))
    missing = ClaimRef("default", "gone", "0000-1111")
    outcomes = claims.prepare([missing, good])
    assert "not found" in outcomes[missing.uid].error and outcomes[missing.uid].devices == []
    assert outcomes[good.uid].error == "" and len(outcomes[good.uid].devices) == 1


def test_past_the_deadline_nothing_is_started(preparer: tuple[DraNode, ClaimPreparer]) -> None:
    node, claims = preparer
    ref = ClaimRef(*node.claim("late", {"request": "r", "device": "gpu-0"}))
    outcome = claims.prepare([ref], deadline=0.0)[ref.uid]
    assert outcome.devices == [] and outcome.error.startswith("not prepared")
    assert claims.held.entries() == []


def needs_dir(enforcement: Enforcement, uuid: str) -> bool:
    """Whether a claim's share of card ``uuid`` gets a cache directory of its own."""
    needs = share_needs(
        enforcement, uuid, NodeDirs(Path("/nowhere")), key="k", memory_mib=1024, cores=None,
        mps=False, claim=True,
    )  # fmt: skip
    return needs.cache_dir is not None


def test_a_share_gets_a_directory_where_the_interposer_counts_or_mps_namespaces() -> None:
    interposer = Enforcement(library=Path("/lib/x.so"), preload_file=None, use_ld_preload_env=True)
    assert needs_dir(interposer, "GPU-0")
    driver = Enforcement(
        library=Path("/lib/x.so"), preload_file=None, use_ld_preload_env=True,
        memory={"GPU-0": "driver"},
    )  # fmt: skip
    assert not needs_dir(driver, "GPU-0")
    assert needs_dir(driver, "GPU-1")  # another card keeps the interposer's
    without = Enforcement(library=None, preload_file=None, use_ld_preload_env=False)
    assert not needs_dir(without, "GPU-0")
