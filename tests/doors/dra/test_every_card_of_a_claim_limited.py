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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_dra_plugin import DraNode

from gpushare.sim.apidouble import KubeApiDouble

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
def node(short_tmp: Path, api: KubeApiDouble) -> Iterator[DraNode]:
    dra = DraNode(short_tmp, api)
    try:
        dra.start()
        yield dra
    finally:
        dra.stop()


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


def test_two_one_card_claims_in_one_container_leave_no_card_unlimited(node: DraNode) -> None:
    """Two claims cannot know each other's index: each sets the limit for every index,
    so no card is ever unlimited (equal shares are exact)."""
    refs = [
        node.claim(
            f"one-{i}",
            {"request": "r", "device": f"gpu-{i}", "consumedCapacity": {"memory": "2Gi"}},
        )
        for i in range(2)
    ]
    answers = node.kubelet.prepare(refs)
    assert all(a.error == "" for a in answers.values())
    _check_every_order(
        [node.spec(r[2]) for r in refs], {"GPU-00000000": 2048, "GPU-00000001": 2048}
    )


_SHARE = st.tuples(st.sampled_from(["gpu-0", "gpu-1"]), st.integers(1, 96), st.integers(0, 100))
_NAMES = itertools.count()


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
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
