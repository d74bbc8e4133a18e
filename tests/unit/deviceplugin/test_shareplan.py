"""A shared-units Allocate decided without a file system (``deviceplugin/shareplan.py``,
``host/grants.share_needs``): for every backend of a card, both resources, with and
without MPS namespaces, the plan says exactly which host directories the grant needs,
where they will be, and its edits mount exactly those; the refusals are plain strings.
Every path here is under a directory that does not exist: nothing is read or made."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from gpushare.deviceplugin.shareplan import partner_refusal, plan_share, span_refusal
from gpushare.host.grants import NodeDirs
from gpushare.host.library import cache_key
from gpushare.share.answers import (
    CONTAINER_CACHE_DIR,
    CONTAINER_MPS_PIPE,
    DriverHook,
    Enforcement,
)
from gpushare.share.devices import Resource, format_device_id
from gpushare.share.pairing import Binding

NOWHERE = Path("/nonexistent/gpushare-plan")
CARD, OTHER = "GPU-a", "GPU-b"
MEMORY = ("interposer", "driver", "soft", "none")
COMPUTE = ("interposer", "mps", "none")


def enforcement(memory: str, compute: str) -> Enforcement:
    if memory == "none":
        on_mps = {CARD: compute} if compute == "mps" else {}
        return Enforcement(None, None, False, compute=on_mps, mps_pipe=NOWHERE / "mps" / "pipe")
    return Enforcement(
        NOWHERE / "libvgpu.so",
        None,
        True,
        memory={CARD: memory} if memory != "interposer" else {},
        compute={CARD: compute} if compute != "interposer" else {},
        driver_hook=DriverHook(str(NOWHERE / "hook")),
        limit_check=str(NOWHERE / "hook"),
        mps_pipe=NOWHERE / "mps" / "pipe",
    )


def units(resource: Resource, count: int) -> list[str]:
    return [format_device_id(CARD, n) for n in range(count)]


@pytest.mark.parametrize(
    "memory,compute,namespaces,resource",
    [
        (m, c, n, r)
        for m, c, n, r in itertools.product(MEMORY, COMPUTE, (False, True), Resource)
        # soft is MPS's pinned limit only; HAMi-core is not loaded into MPS clients
        if not (m == "soft" and c != "mps") and not (m == "interposer" and c == "mps")
    ],
)
def test_the_plan_names_exactly_the_host_side_its_edits_mount(
    memory: str, compute: str, namespaces: bool, resource: Resource
) -> None:
    dirs = NodeDirs(NOWHERE, NOWHERE / "mps" / "pipe" / "gpushare" if namespaces else None)
    ids = units(resource, 4)
    partner = Binding(resource.other, CARD, tuple(units(resource.other, 2)), 0.0)
    plan = plan_share(
        resource,
        CARD,
        range(4),
        ids,
        enforcement=enforcement(memory, compute),
        unit_mib=256,
        dirs=dirs,
        mps=True,
        listing=None,
        partner=partner,
    )
    needs = plan.needs
    mounts = {m.container_path: m for m in plan.edits.mounts}
    counts_memory = memory == "interposer" and resource is Resource.MEMORY
    assert (needs.cache_dir is not None) == counts_memory
    if counts_memory:
        assert needs.cache_dir == NOWHERE / "containers" / cache_key(ids)
        assert mounts[CONTAINER_CACHE_DIR].host_path == str(needs.cache_dir)
    else:
        assert CONTAINER_CACHE_DIR not in mounts
    on_mps = compute == "mps"
    assert (needs.mps is not None) == on_mps
    if on_mps:
        assert needs.mps is not None and needs.mps.partner == partner.device_ids
        assert needs.mps.pinned == (memory == "soft")
        assert (needs.mps.memory_mib, needs.mps.cores) == (
            (1024, None) if resource is Resource.MEMORY else (None, 4)
        )
    own_namespace = on_mps and namespaces and resource is Resource.MEMORY
    assert (needs.mps_pipe is not None) == own_namespace
    if own_namespace:
        assert needs.mps_pipe == dirs.mps_namespaces / cache_key(ids)  # type: ignore[operator]
        assert mounts[CONTAINER_MPS_PIPE].host_path == str(needs.mps_pipe)
    assert plan.spec_name.startswith(resource.value + "-")
    assert plan.device_ids == tuple(ids) and plan.numbers == (0, 1, 2, 3)
    assert not NOWHERE.exists()


def test_refusals_are_decided_from_plain_facts() -> None:
    def describe(uuid: str) -> str:
        return f"card {uuid}"

    spread = {CARD: [0, 1], OTHER: [5]}
    refusal = span_refusal(Resource.MEMORY, spread, 3, describe)
    assert refusal is not None and "span 2" in refusal and "card GPU-b: 1 units" in refusal
    assert span_refusal(Resource.MEMORY, {CARD: [0]}, 1, describe) is None
    partner = Binding(Resource.MEMORY, OTHER, ("x",), 0.0)
    refused = partner_refusal(Resource.CORE, CARD, partner, describe)
    assert refused is not None and "card GPU-b" in refused and "card GPU-a" in refused
    assert partner_refusal(Resource.CORE, OTHER, partner, describe) is None
    assert partner_refusal(Resource.CORE, CARD, None, describe) is None
