"""gpushare.dra.rebuild's decision, pure: what a prepared claim's entry makes again of its
host side given what is there, for every kind of host side (a cache directory, a
``driver`` card's holder directory, an MPS namespace), and never anything outside the
node's own directories."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushare.dra.checkpoint import PREPARED, ClaimEntry
from gpushare.dra.rebuild import HostFound, plan_rebuild
from gpushare.host.grants import HostNeeds, MpsNeed, NodeDirs, needs_from_record, needs_record

DIRS = NodeDirs(Path("/usr/local/vgpu"), mps_namespaces=Path("/run/mps/server"))
SPEC = {"cdiVersion": "0.5.0", "kind": "gpu.gpushare.io/claim", "devices": [{"name": "x"}]}


def need(key: str, kind: str) -> HostNeeds:
    if kind == "cache":
        return HostNeeds(key, cache_dir=DIRS.cache_dir(key))
    if kind == "holder":
        return HostNeeds(key, holder=DIRS.holder(key))
    assert DIRS.mps_namespaces is not None
    mps = MpsNeed(1024, 30, pinned=False, claim=True)
    return HostNeeds(key, mps=mps, mps_pipe=DIRS.mps_namespaces / key)


def paths_of(n: HostNeeds) -> set[Path]:
    found = {p for p in (n.cache_dir, n.holder, n.mps_pipe) if p is not None}
    return found | ({DIRS.cache_dir(n.key)} if n.mps is not None else set())


def entry(needs: list[HostNeeds]) -> ClaimEntry:
    return ClaimEntry(
        "ns",
        "c",
        PREPARED,
        spec_name="uid",
        cache_keys=[n.key for n in needs],
        spec=SPEC,
        made=[needs_record(n) for n in needs],
    )


KINDS = st.lists(st.sampled_from(["cache", "holder", "mps"]), min_size=1, max_size=4)


@given(kinds=KINDS, data=st.data())
def test_what_is_made_again_is_exactly_what_is_missing(
    kinds: list[str], data: st.DataObject
) -> None:
    needs = [need(f"d-{i:020x}", kind) for i, kind in enumerate(kinds)]
    everything = set().union(*(paths_of(n) for n in needs))
    present = frozenset(data.draw(st.sets(st.sampled_from(sorted(everything)))))
    spec_there = data.draw(st.booleans())
    found = HostFound(SPEC if spec_there else None, "" if spec_there else "missing", present)
    plan = plan_rebuild(entry(needs), found, DIRS)
    if spec_there and present == everything:
        assert plan is None
        return
    assert plan is not None and not plan.replan
    assert plan.spec == (None if spec_there else SPEC)
    made = set().union(set(), *(paths_of(n) for n in plan.needs))
    # every missing directory is made again; a directory there is never made afresh
    # (the MPS marker goes with its namespace: made when the namespace is)
    assert everything - present <= made
    lone = {p for n in plan.needs if n.mps is None for p in paths_of(n)}
    assert not lone & present


def test_a_record_naming_a_directory_elsewhere_is_refused() -> None:
    record = needs_record(need("d-" + "0" * 20, "cache"))
    record["cache_dir"] = "/etc/cron.d"
    with pytest.raises(ValueError, match="not where this node keeps it"):
        needs_from_record(record, DIRS)
    moved = NodeDirs(Path("/var/lib/gpushare"))
    with pytest.raises(ValueError):
        needs_from_record(needs_record(need("d-" + "0" * 20, "cache")), moved)


def test_a_changed_spec_is_written_back() -> None:
    needs = [need("d-" + "1" * 20, "cache")]
    present = frozenset(paths_of(needs[0]))
    forged = {**SPEC, "devices": [{"name": "y"}]}
    plan = plan_rebuild(entry(needs), HostFound(forged, "", present), DIRS)
    assert plan is not None and plan.spec == SPEC and plan.needs == ()
    assert plan.lost == ("spec changed",)


def test_an_entry_that_kept_no_spec_is_planned_again() -> None:
    old = ClaimEntry("ns", "c", PREPARED, spec_name="uid", cache_keys=["d-" + "2" * 20])
    there = frozenset({DIRS.cache_dir("d-" + "2" * 20)})
    assert plan_rebuild(old, HostFound(SPEC, "", there), DIRS) is None
    plan = plan_rebuild(old, HostFound(None, "missing", there), DIRS)
    assert plan is not None and plan.replan and plan.lost == ("spec missing",)
