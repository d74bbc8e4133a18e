"""What a host cleanup after an uninstall removes (``host/sweepplan.py`` over
``host/leftovers.py``), decided on names alone: with nothing held, nothing of ours is
left; a held name is never removed; a name not ours is never touched."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpushare.host.leftovers import CACHE_MOUNT, SHM_MOUNT, Held, Seen
from gpushare.host.sweepplan import (
    DEVICE_PLUGINS,
    DRA_PLUGIN,
    REGISTRY,
    Naming,
    Places,
    sweep,
)

NAMING = Naming("gpushare.io", "gpu.gpushare.io")
CDI = "/var/run/cdi"
A = "a" * 12
KEY1, KEY2 = "1" * 20, "2" * 20
GRANT1, GRANT2 = f"vcuda-memory-{'3' * 20}", f"whole-{'4' * 20}"
UID1, UID2 = "0b1e0c1a-0000-4000-8000-000000000001", "0b1e0c1a-0000-4000-8000-000000000002"

OUR_TOP = frozenset(
    {
        f"libvgpu.so.{A}",
        f"ld.so.preload.{A}",
        f"gpushare-memory-hook.{A}",
        "memory-unit.json",
        "libraries.json",
        "containers",
        "mps",
        "claimholders",
        "dra",
        ".tomb-1-2",
    }
)
OUR_CONTAINERS = frozenset(
    {f"c-{KEY1}", f"c-{KEY1}.json", f"c-{KEY2}", f"d-{KEY2}", "vgpulock", ".tomb-3-4"}
)
OUR_SOCKETS = frozenset({"gpushare-vcuda-memory.sock", "gpushare-vcuda-core.0a1b2c3d-2.sock"})
OUR_SPECS = frozenset(
    {
        f"gpushare.io-grant_{GRANT1}.json",
        f"gpushare.io-grant_{GRANT2}.json",
        f"gpu.gpushare.io-claim_{UID1}.json",
        f"gpu.gpushare.io-claim_{UID2}.json",
        f".gpu.gpushare.io-claim_{UID1}.json.12.34.tmp",
    }
)
FOREIGN_TOP = frozenset({"test", "operator-notes.txt"})
FOREIGN_CONTAINERS = frozenset({"stray"})
FOREIGN_SOCKETS = frozenset({"kubelet.sock", "nvidia-gpu.sock", "gpushare.sock.bak"})
FOREIGN_SPECS = frozenset({"nvidia.yaml", "gpushare.io-other_x.json", ".nvidia.tmp"})


def places(sockets: frozenset[str], specs: frozenset[str]) -> Places:
    found = {
        DEVICE_PLUGINS: sockets,
        REGISTRY: frozenset({"gpu.gpushare.io-reg.sock", "other.example-reg.sock"}),
        DRA_PLUGIN: frozenset({"dra.sock"}),
        CDI: specs,
    }
    return Places(found, frozenset({CDI}))


def test_with_nothing_held_nothing_of_ours_is_left_and_the_tmpfs_mounts_go() -> None:
    seen = Seen(OUR_TOP, OUR_CONTAINERS, mounted=frozenset({CACHE_MOUNT, SHM_MOUNT}))
    done = sweep(seen, places(OUR_SOCKETS, OUR_SPECS), NAMING, Held(claim_uids=frozenset()))
    assert set(done.host.remove) == (OUR_TOP - {"containers"}) | {
        f"containers/{n}" for n in OUR_CONTAINERS
    }
    assert done.host.drop_cache_root and done.host.drop_host_dir
    assert done.host.unmount == (CACHE_MOUNT, SHM_MOUNT)
    assert set(done.remove) == {(DEVICE_PLUGINS, n) for n in OUR_SOCKETS} | {
        (CDI, n) for n in OUR_SPECS
    } | {(REGISTRY, "gpu.gpushare.io-reg.sock"), (DRA_PLUGIN, "dra.sock")}
    assert done.rmdir == (DRA_PLUGIN,) and done.keep == {} and done.host.keep == {}


def test_a_running_container_and_a_claim_in_use_keep_exactly_what_they_hold() -> None:
    seen = Seen(OUR_TOP, OUR_CONTAINERS, mounted=frozenset({CACHE_MOUNT, SHM_MOUNT}))
    held = Held(
        cache_keys=frozenset({f"c-{KEY1}"}),
        holders=frozenset({"ns/p/c/d"}),
        claims=True,
        grants=frozenset({GRANT1}),
        claim_uids=frozenset({UID1}),
    )
    done = sweep(seen, places(OUR_SOCKETS, OUR_SPECS), NAMING, held)
    assert set(done.keep) == {
        f"{CDI}/gpushare.io-grant_{GRANT1}.json",
        f"{CDI}/gpu.gpushare.io-claim_{UID1}.json",
    }
    assert (CDI, f"gpushare.io-grant_{GRANT2}.json") in done.remove
    assert (CDI, f"gpu.gpushare.io-claim_{UID2}.json") in done.remove
    assert {"mps", "claimholders", "dra", f"containers/c-{KEY1}", f"containers/d-{KEY2}"} <= set(
        done.host.keep
    )
    assert f"containers/c-{KEY2}" in done.host.remove
    assert done.host.unmount == () and not done.host.drop_host_dir
    # the sockets go all the same: the daemon that served them is gone
    assert (DEVICE_PLUGINS, "gpushare-vcuda-memory.sock") in done.remove


def test_claims_in_use_that_cannot_be_told_keep_every_claim_spec() -> None:
    done = sweep(Seen(frozenset()), places(frozenset(), OUR_SPECS), NAMING, Held(claims=True))
    assert f"{CDI}/gpu.gpushare.io-claim_{UID2}.json" in done.keep
    assert (CDI, f"gpushare.io-grant_{GRANT1}.json") in done.remove


def test_a_dra_plugin_directory_holding_more_than_our_socket_stays() -> None:
    found = Places({DRA_PLUGIN: frozenset({"dra.sock", "someone-else"})})
    done = sweep(Seen(frozenset()), found, NAMING, Held())
    assert done.remove == ((DRA_PLUGIN, "dra.sock"),) and done.rmdir == ()


def test_an_empty_host_directory_goes_and_one_with_a_name_not_ours_stays() -> None:
    assert sweep(Seen(frozenset()), Places(), NAMING, Held()).host.drop_host_dir
    done = sweep(Seen(frozenset({"test", "mps"})), Places(), NAMING, Held())
    assert done.host.remove == ("mps",) and not done.host.drop_host_dir


def test_a_tmpfs_over_a_directory_that_keeps_names_not_ours_stays_mounted() -> None:
    seen = Seen(frozenset({"containers"}), frozenset({"stray"}), mounted=frozenset({CACHE_MOUNT}))
    done = sweep(seen, Places(), NAMING, Held())
    assert done.host.unmount == () and done.host.keep == {"containers": "holds names not ours"}


def _subsets(names: frozenset[str]) -> st.SearchStrategy[frozenset[str]]:
    return st.frozensets(st.sampled_from(sorted(names)))


@given(
    top=_subsets(OUR_TOP | FOREIGN_TOP),
    containers=_subsets(OUR_CONTAINERS | FOREIGN_CONTAINERS),
    mounted=_subsets(frozenset({CACHE_MOUNT, SHM_MOUNT})),
    sockets=_subsets(OUR_SOCKETS | FOREIGN_SOCKETS),
    specs=_subsets(OUR_SPECS | FOREIGN_SPECS),
    cache_keys=_subsets(frozenset({f"c-{KEY1}", f"c-{KEY2}"})),
    holders=_subsets(frozenset({"a/p/c/1"})),
    grants=_subsets(frozenset({GRANT1, GRANT2})),
    uids=st.one_of(st.none(), _subsets(frozenset({UID1, UID2}))),
)
def test_held_names_stay_foreign_names_are_never_touched_and_nothing_held_leaves_nothing(
    top: frozenset[str],
    containers: frozenset[str],
    mounted: frozenset[str],
    sockets: frozenset[str],
    specs: frozenset[str],
    cache_keys: frozenset[str],
    holders: frozenset[str],
    grants: frozenset[str],
    uids: frozenset[str] | None,
) -> None:
    claims = uids is None or bool(uids)
    held = Held(cache_keys, holders, claims, grants, uids)
    seen = Seen(top, containers if "containers" in top else frozenset(), mounted=mounted)
    done = sweep(seen, places(sockets, specs), NAMING, held)
    removed_host = set(done.host.remove)
    removed = {name for _, name in done.remove}
    # a name not ours is never touched
    assert not removed_host & (FOREIGN_TOP | {f"containers/{n}" for n in FOREIGN_CONTAINERS})
    assert not removed & (FOREIGN_SOCKETS | FOREIGN_SPECS | {"other.example-reg.sock"})
    # a held name is never removed
    for key in cache_keys:
        assert f"containers/{key}" not in removed_host
    assert not {f"gpushare.io-grant_{g}.json" for g in grants} & removed
    for uid in {UID1, UID2} if uids is None else uids:
        assert f"gpu.gpushare.io-claim_{uid}.json" not in removed
    if claims:
        assert not {"claimholders", "dra", f"containers/d-{KEY2}"} & removed_host
    if held.memory:
        assert not {"mps", "memory-unit.json", "containers/vgpulock"} & removed_host
    # a tmpfs is unmounted only when nothing under it stays
    if CACHE_MOUNT in done.host.unmount:
        assert not [n for n in done.host.keep if n.startswith("containers")]
    if SHM_MOUNT in done.host.unmount:
        assert "mps" in removed_host
    # nothing held and nothing foreign: nothing of ours is left, the host directory goes
    nothing_held = not (cache_keys or holders or grants or claims)
    if nothing_held:
        assert done.keep == {} and set(done.host.keep) <= {"containers"}  # names not ours
        assert removed == (sockets & OUR_SOCKETS) | (specs & OUR_SPECS) | {
            "gpu.gpushare.io-reg.sock",
            "dra.sock",
        }
        foreign_inside = "containers" in top and containers & FOREIGN_CONTAINERS
        if not top & FOREIGN_TOP and not foreign_inside:
            assert done.host.drop_host_dir and done.host.keep == {}
            assert set(done.host.unmount) == {
                m
                for m in mounted
                if (m == CACHE_MOUNT and "containers" in top) or (m == SHM_MOUNT and "mps" in top)
            }
