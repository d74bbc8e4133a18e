"""gpushare.dra.recovery: after a lost checkpoint entry the claim's CDI spec is the
proof a container may run with it: the entry is recovered from the spec (its cache
directory, its limits) and kept; a claim cache directory nothing names is removed; an
unprepare of a claim with no entry removes what its spec names; a directory standing
where a spec should be is left alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_dra_plugin import DraNode

from gpushare.dra.checkpoint import RECOVERED
from gpushare.dra.claimread import ClaimRef
from gpushare.dra.claims import ClaimPreparer
from gpushare.dra.recovery import UNKNOWN_NAMESPACE, Leftovers, remove_spec_file
from gpushare.host.library import CLAIM_KEY_PREFIX, cache_root
from gpushare.sim.apidouble import KubeApiDouble


@pytest.fixture
def preparer(short_tmp: Path, api: KubeApiDouble) -> Iterator[tuple[DraNode, ClaimPreparer]]:
    node = DraNode(short_tmp, api)
    part = node.build()
    part.preparer.tidy()
    try:
        yield node, part.preparer
    finally:
        part.preparer.lock.close()


SHARE = {"request": "r", "device": "gpu-0", "consumedCapacity": {"memory": "3Gi", "cores": "40"}}


def prepared(node: DraNode, claims: ClaimPreparer) -> ClaimRef:
    ref = ClaimRef(*node.claim("share", SHARE))
    assert claims.prepare([ref])[ref.uid].error == ""
    return ref


def claim_dirs(node: DraNode) -> list[str]:
    return sorted(p.name for p in cache_root(node.host).iterdir() if p.is_dir()
                  and p.name.startswith(CLAIM_KEY_PREFIX))  # fmt: skip


def test_a_lost_entry_is_recovered_from_the_spec_and_kept(
    preparer: tuple[DraNode, ClaimPreparer],
) -> None:
    node, claims = preparer
    ref = prepared(node, claims)
    leftovers: Leftovers = claims.leftovers
    original = leftovers.entry(ref.uid)
    assert original is not None and original.cache_keys
    claims.checkpoint.delete(ref.uid)  # a daemon killed, a state directory emptied
    stray = cache_root(node.host) / f"{CLAIM_KEY_PREFIX}never-handed-out"
    stray.mkdir()
    held = leftovers.tidy()
    entry = held[ref.uid]
    assert entry.state == RECOVERED and entry.namespace == UNKNOWN_NAMESPACE
    assert entry.cache_keys == original.cache_keys  # kept: a container may use it
    (device,) = entry.devices
    assert (device.memory_mib, device.cores, device.card) == (3072, 40, "GPU-00000000")
    assert claim_dirs(node) == original.cache_keys  # the stray one is gone
    assert leftovers.spec_path(ref.uid).is_file()


def test_unprepare_without_an_entry_removes_what_the_spec_names(
    preparer: tuple[DraNode, ClaimPreparer],
) -> None:
    node, claims = preparer
    ref = prepared(node, claims)
    claims.checkpoint.delete(ref.uid)
    assert claims.leftovers.release_unknown(ref.uid) is True
    assert not claims.leftovers.spec_path(ref.uid).exists()
    assert claim_dirs(node) == []
    assert claims.leftovers.release_unknown(ref.uid) is False  # nothing left


def test_a_spec_that_is_not_ours_is_an_error_not_an_entry(
    preparer: tuple[DraNode, ClaimPreparer],
) -> None:
    _node, claims = preparer
    path = claims.leftovers.spec_path("abc-1")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        claims.leftovers.recover("abc-1")
    path.write_text('{"devices": 3}')
    with pytest.raises(ValueError, match="no devices list"):
        claims.leftovers.recover("abc-1")
    assert claims.leftovers.recover("no-such-claim") is None


def test_only_a_file_is_removed_as_a_spec(tmp_path: Path) -> None:
    spec = tmp_path / "spec.json"
    spec.write_text("{}")
    assert remove_spec_file(spec) is True and not spec.exists()
    assert remove_spec_file(spec) is False
    spec.mkdir()
    assert remove_spec_file(spec) is False and spec.is_dir()
