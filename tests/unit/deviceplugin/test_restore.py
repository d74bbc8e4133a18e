"""gpushare.deviceplugin.restore's decision, pure: for any holdings and any state of the
node, exactly what is missing of their grants is made again (a spec only where answers
are sealed), a directory there is never made afresh, one a runtime made is repaired, and a
container's MPS namespace is made by its memory grant before its core grant caps it."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from gpushare.deviceplugin.restore import OnNode, Regrant, plan_restores
from gpushare.host.grants import HostNeeds, MpsNeed
from gpushare.share.answers import ContainerEdits
from gpushare.share.usage import Holder

ROOT = Path("/usr/local/vgpu/containers")
PIPES = Path("/run/mps/server")


def holding(i: int, kind: str) -> Regrant:
    holder = Holder("ns", f"p{i}", "main")
    if kind == "memory":
        key = f"c-{i:020x}"
        return Regrant(
            holder, "gpushare.io/vcuda-memory", f"m{i}", ContainerEdits(),
            HostNeeds(key, units=(f"u{i}",), cache_dir=ROOT / key), first=True,
        )  # fmt: skip
    if kind == "cores":
        return Regrant(holder, "gpushare.io/vcuda-core", f"c{i}", ContainerEdits(), None)
    return Regrant(holder, "gpushare.io/gpu", f"w{i}", ContainerEdits(), None)


@given(
    kinds=st.lists(st.sampled_from(["memory", "cores", "whole"]), min_size=1, max_size=6),
    seals=st.booleans(),
    data=st.data(),
)
def test_exactly_what_is_missing_is_made_again(
    kinds: list[str], seals: bool, data: st.DataObject
) -> None:
    regrants = [holding(i, k) for i, k in enumerate(kinds)]
    names = sorted(r.spec_name for r in regrants)
    dirs = sorted(r.needs.cache_dir for r in regrants if r.needs and r.needs.cache_dir)
    specs = frozenset(data.draw(st.sets(st.sampled_from(names))))
    present = frozenset(data.draw(st.sets(st.sampled_from(dirs)))) if dirs else frozenset()
    foreign = (
        frozenset(data.draw(st.sets(st.sampled_from(sorted(present))))) if present else frozenset()
    )
    restores = plan_restores(regrants, OnNode(specs, present, foreign), seals=seals)
    by_name = {r.regrant.spec_name: r for r in restores}
    for regrant in regrants:
        restore = by_name.get(regrant.spec_name)
        spec_lost = seals and regrant.spec_name not in specs
        cache = regrant.needs.cache_dir if regrant.needs else None
        dir_lost = cache is not None and cache not in present
        repair = cache is not None and cache in foreign
        if not (spec_lost or dir_lost or repair):
            assert restore is None
            continue
        assert restore is not None
        assert restore.spec == spec_lost
        made = restore.needs.cache_dir if restore.needs is not None else None
        assert made == (cache if dir_lost else None)
        assert restore.needs is None or restore.needs.keep  # never made afresh
        assert restore.repair == (cache.name if repair and cache is not None else None)


def test_a_containers_namespace_is_made_by_its_memory_grant_then_capped_by_its_cores() -> None:
    holder = Holder("ns", "p", "main")
    key = "c-" + "a" * 20
    memory = Regrant(
        holder, "gpushare.io/vcuda-memory", "m", ContainerEdits(),
        HostNeeds(key, units=("u",), mps=MpsNeed(1024, None, False, ("k",)), mps_pipe=PIPES / key),
        first=True,
    )  # fmt: skip
    cores = Regrant(
        holder, "gpushare.io/vcuda-core", "c", ContainerEdits(),
        HostNeeds("c-" + "b" * 20, units=("k",), mps=MpsNeed(None, 30, False, ("u",))),
    )  # fmt: skip
    found = OnNode(frozenset({"m", "c"}), frozenset())
    restores = plan_restores([cores, memory], found, seals=True)
    assert [r.regrant.spec_name for r in restores] == ["m", "c"]
    assert restores[0].needs is not None and restores[0].needs.mps is not None
    assert restores[1].needs is not None and restores[1].needs.mps is not None
    # with its namespace there, nothing is made
    there = OnNode(frozenset({"m", "c"}), frozenset({PIPES / key}))
    assert plan_restores([cores, memory], there, seals=True) == []
