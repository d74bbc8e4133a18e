"""What uninstall may remove from the host directory (``host/leftovers.py``): nothing a
listed container can use, everything else gpushare wrote, never a name it did not write."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpushare.host.leftovers import Held, Seen, plan

A, B = "a" * 12, "b" * 12
KEY1, KEY2 = "1" * 20, "2" * 20
EVERYTHING = Seen(
    top=frozenset(
        {
            f"libvgpu.so.{A}",
            f"ld.so.preload.{A}",
            f"libvgpu.so.{B}",
            f"ld.so.preload.{B}",
            f"gpushare-memory-hook.{A}",
            "memory-unit.json",
            "libraries.json",
            "containers",
        }
    ),
    containers=frozenset(
        {f"c-{KEY1}", f"c-{KEY1}.json", f"c-{KEY2}", f"c-{KEY2}.json", "vgpulock", ".tomb-x-1"}
    ),
    retired={B: frozenset({"ns/old/c/d1"})},
)


def test_with_no_container_left_everything_gpushare_wrote_goes() -> None:
    done = plan(EVERYTHING, Held())
    assert set(done.remove) == set(EVERYTHING.top - {"containers"}) | {
        f"containers/{n}" for n in EVERYTHING.containers
    }
    assert done.keep == {} and done.drop_cache_root
    assert done.remove[-1] == "libraries.json"  # after the versions it describes


def test_a_running_container_keeps_its_cache_the_library_and_what_it_reads() -> None:
    held = Held(cache_keys=frozenset({f"c-{KEY1}"}), holders=frozenset({"ns/new/c/d2"}))
    done = plan(EVERYTHING, held)
    assert f"containers/c-{KEY2}" in done.remove and f"containers/c-{KEY2}.json" in done.remove
    assert "containers/.tomb-x-1" in done.remove
    # B was retired while only ns/old/c ran: it is gone, so is B
    assert f"libvgpu.so.{B}" in done.remove and f"ld.so.preload.{B}" in done.remove
    assert set(done.keep) == {
        f"containers/c-{KEY1}",
        f"containers/c-{KEY1}.json",
        "containers/vgpulock",
        "containers",
        f"libvgpu.so.{A}",
        f"ld.so.preload.{A}",
        f"gpushare-memory-hook.{A}",
        "memory-unit.json",
        "libraries.json",
    }
    assert not done.drop_cache_root


def test_a_retired_version_stays_while_a_container_alive_at_its_retirement_runs() -> None:
    held = Held(holders=frozenset({"ns/old/c/d1"}))
    done = plan(EVERYTHING, held)
    assert done.keep[f"libvgpu.so.{B}"] == "mounted by 1 running container(s)"
    assert "libraries.json" in done.keep


def test_names_gpushare_did_not_write_are_never_touched() -> None:
    seen = Seen(top=frozenset({"notes.txt", "containers"}), containers=frozenset({"mine"}))
    done = plan(seen, Held())
    assert done.remove == () and not done.drop_cache_root
    assert done.keep == {"containers": "holds names not ours"}


def test_dra_claim_caches_stay_while_claims_are_prepared() -> None:
    seen = Seen(top=frozenset({"containers"}), containers=frozenset({f"d-{KEY1}"}))
    assert plan(seen, Held(claims=True)).keep[f"containers/d-{KEY1}"]
    assert plan(seen, Held()).remove == (f"containers/d-{KEY1}",)


keys = st.sampled_from([KEY1, KEY2, "3" * 20])
versions = st.sampled_from([A, B, "c" * 12])
holders = st.sampled_from(["x/p/c/1", "y/p/c/2", "z/p/c/3"])
top_names = st.one_of(
    versions.map(lambda v: f"libvgpu.so.{v}"),
    versions.map(lambda v: f"ld.so.preload.{v}"),
    versions.map(lambda v: f"gpushare-memory-hook.{v}"),
    st.sampled_from(["memory-unit.json", "libraries.json", "containers", "operator-notes"]),
)
cache_names = st.one_of(
    keys.map(lambda k: f"c-{k}"),
    keys.map(lambda k: f"c-{k}.json"),
    keys.map(lambda k: f"d-{k}"),
    st.sampled_from(["vgpulock", ".tomb-1-2", "stray"]),
)


@given(
    top=st.frozensets(top_names),
    containers=st.frozensets(cache_names),
    retired=st.dictionaries(versions, st.frozensets(holders)),
    cache_keys=st.frozensets(keys.map(lambda k: f"c-{k}")),
    alive=st.frozensets(holders),
    claims=st.booleans(),
)
def test_nothing_a_listed_container_can_use_is_ever_removed(
    top: frozenset[str],
    containers: frozenset[str],
    retired: dict[str, frozenset[str]],
    cache_keys: frozenset[str],
    alive: frozenset[str],
    claims: bool,
) -> None:
    seen = Seen(top, containers, retired)
    held = Held(cache_keys, alive, claims)
    done = plan(seen, held)
    removed = set(done.remove)
    assert len(removed) == len(done.remove) and not removed & set(done.keep)
    assert removed <= set(top) | {f"containers/{n}" for n in containers}
    assert "operator-notes" not in removed and "containers/stray" not in removed
    assert not {f"containers/{k}" for k in cache_keys} & removed
    assert not {f"containers/{k}.json" for k in cache_keys} & removed
    if claims:
        assert not {n for n in removed if n.startswith("containers/d-")}
    if held.memory:
        for name in ("memory-unit.json", "containers/vgpulock"):
            assert name not in removed
        for name in removed:
            if name.startswith(("libvgpu.so.", "ld.so.preload.")):
                version = name.rsplit(".", 1)[1]
                assert version in retired and not retired[version] & alive, name
        assert not [n for n in removed if n.startswith("gpushare-memory-hook.")]
    if done.drop_cache_root:
        assert not [n for n in done.keep if n.startswith("containers")]
        assert "containers/stray" not in {f"containers/{n}" for n in containers}
    if any(n.startswith(("libvgpu.so.", "ld.so.preload.")) for n in done.keep):
        assert "libraries.json" not in removed
