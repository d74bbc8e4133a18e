"""A DRA container's own env cannot change its claim's limits (issue 32 item 1, DRA part).

The admission policy gives a container that uses a DRA claim the mount rule only (it
cannot tell a gpushare claim from another driver's), so the container's pod env may set
any reserved name. The kubelet hands that env to the runtime, and the runtime applies
the claim's CDI edits after it, replacing what they set by name. Before, a claim's spec
set ``CUDA_DEVICE_MEMORY_LIMIT_0``, the un-indexed memory and core limits and nothing
else: a pod setting ``CUDA_DEVICE_MEMORY_LIMIT_1=99999m``, ``CUDA_DEVICE_SM_LIMIT_0=100``
(it outranks ``CUDA_DEVICE_SM_LIMIT``), ``GPU_CORE_UTILIZATION_POLICY=disable`` or
``CUDA_DISABLE_CONTROL=true`` kept its value. Now every share result of a claim sets
every index HAMi-core reads (0-15) and its switches (the policy, the control switch,
``CUDA_REDIRECT``, ``ACTIVE_OOM_KILLER``, ``CUDA_TASK_PRIORITY``) at the values that behave
as if unset. Here the real
prepare over the real DRA socket, its spec applied over hostile envs as a runtime does.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_dra_plugin import DraNode, dra

from gpushare.share.reserved import RESERVED_NAMES, RESERVED_PREFIXES, env_reserved

__all__ = ["dra"]  # fixture

MIB = 1 << 20
#: HAMi-core's CUDA_DEVICE_MAX_COUNT: the indices whose limits it reads.
INDEXES = 16
HOSTILE = {
    "CUDA_DEVICE_MEMORY_LIMIT_0": "99999m",
    "CUDA_DEVICE_MEMORY_LIMIT_1": "99999m",
    "CUDA_DEVICE_MEMORY_LIMIT_15": "99999m",
    "CUDA_DEVICE_MEMORY_LIMIT": "99999m",
    "CUDA_DEVICE_SM_LIMIT": "100",
    "CUDA_DEVICE_SM_LIMIT_0": "100",
    "CUDA_DEVICE_SM_LIMIT_1": "100",
    "CUDA_DEVICE_SM_LIMIT_15": "100",
    "GPU_CORE_UTILIZATION_POLICY": "disable",
    "CUDA_DISABLE_CONTROL": "true",
    "LD_PRELOAD": "",
    "CUDA_REDIRECT": "/tmp/tenant.so",
    "ACTIVE_OOM_KILLER": "false",
    "CUDA_TASK_PRIORITY": "0",
}
#: HAMi-core's switches at the values that behave as if unset (its source: an empty
#: CUDA_REDIRECT loads /usr/local/vgpu/libvgpu.so, unset ACTIVE_OOM_KILLER is on, unset
#: CUDA_TASK_PRIORITY is 1).
NEUTRAL = {
    "GPU_CORE_UTILIZATION_POLICY": "default",
    "CUDA_DISABLE_CONTROL": "false",
    "CUDA_REDIRECT": "",
    "ACTIVE_OOM_KILLER": "true",
    "CUDA_TASK_PRIORITY": "1",
}


def applied(pod_env: dict[str, str], spec: dict[str, Any]) -> dict[str, str]:
    """The container's final env: its pod env, then every CDI device's edits in turn
    (a later edit replaces a name an earlier one, or the pod, set), as a runtime does."""
    env = dict(pod_env)
    for device in spec["devices"]:
        for entry in device["containerEdits"].get("env", []):
            name, value = entry.split("=", 1)
            env[name] = value
    return env


def _bytes(value: str | None) -> int:
    """HAMi-core's reading of a memory limit (0: none; a value it cannot read counts
    as huge here, so the test never under-reads a limit)."""
    if not value:
        return 0
    scale = {"g": 1 << 30, "m": 1 << 20, "k": 1 << 10}.get(value[-1].lower(), 1)
    digits = value[:-1] if scale != 1 else value
    return int(digits) * scale if digits.isdigit() else 1 << 62


def hami_limits(env: dict[str, str], index: int) -> tuple[int | None, int | None]:
    """Device ``index``'s (memory bytes, core percent) as HAMi-core takes them; None: no
    limit (the indexed name first, then the un-indexed one; its switches drop them)."""
    if env.get("CUDA_DISABLE_CONTROL", "false").lower() not in ("", "false", "0"):
        return None, None
    memory = _bytes(env.get(f"CUDA_DEVICE_MEMORY_LIMIT_{index}")) or _bytes(
        env.get("CUDA_DEVICE_MEMORY_LIMIT")
    )
    core_text = env.get(f"CUDA_DEVICE_SM_LIMIT_{index}") or env.get("CUDA_DEVICE_SM_LIMIT")
    cores = int(core_text) if core_text and core_text.isdigit() else None
    if env.get("GPU_CORE_UTILIZATION_POLICY", "default") == "disable":
        cores = None
    return memory or None, cores if cores else None


@pytest.fixture
def node(dra: DraNode) -> DraNode:
    """The DRA node of ``test_dra_plugin``'s ``dra``, started (``dra`` stops it)."""
    dra.start()
    return dra


def _prepared(node: DraNode) -> dict[str, Any]:
    """A claim of 2 GiB and 30 % on each of the node's two cards, prepared over the socket."""
    share = {"memory": "2Gi", "cores": "30"}
    ref = node.claim(
        "hostile",
        {"request": "a", "device": "gpu-0", "consumedCapacity": share},
        {"request": "b", "device": "gpu-1", "consumedCapacity": share},
    )
    (answer,) = node.kubelet.prepare([ref]).values()
    assert answer.error == ""
    return node.spec(ref[2])


def test_a_hostile_pod_env_is_replaced_by_the_claims_edits(node: DraNode) -> None:
    spec = _prepared(node)
    assert all(env_reserved(name) for name in HOSTILE)
    env = applied(HOSTILE, spec)
    for index in range(INDEXES):
        assert env[f"CUDA_DEVICE_MEMORY_LIMIT_{index}"] == "2048m", index
        assert env[f"CUDA_DEVICE_SM_LIMIT_{index}"] == "30", index
        assert hami_limits(env, index) == (2048 * MIB, 30), index
    assert env["CUDA_DEVICE_MEMORY_LIMIT"] == "2048m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30"
    assert {name: env[name] for name in NEUTRAL} == NEUTRAL
    assert env["LD_PRELOAD"] == "/usr/local/vgpu/libvgpu.so"


_INDEXED = st.builds(
    lambda prefix, index: f"{prefix}_{index}" if index is not None else prefix,
    st.sampled_from(RESERVED_PREFIXES),
    st.one_of(st.none(), st.integers(0, 40)),
)
_NAMES = st.one_of(st.sampled_from(RESERVED_NAMES), _INDEXED)
_VALUES = st.one_of(
    st.sampled_from(["99999m", "100", "0", "", "disable", "force", "true", "1", "64g", "none"]),
    st.text(alphabet="0123456789mgkMGK", max_size=8),
)


@pytest.mark.parametrize(
    "examples", [60, pytest.param(300, marks=pytest.mark.slow)], ids=["quick", "full"]
)
def test_no_hostile_env_of_reserved_names_lifts_a_limit(node: DraNode, examples: int) -> None:
    """Random pod envs of reserved names (share/reserved.py), any value: after the
    claim's CDI edits every index HAMi-core reads is limited to at most the claim's
    share (memory and cores), and no switch is left that drops the limits. make test
    tries 60 envs; the 300 run under ``slow``."""
    spec = _prepared(node)

    @settings(
        max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    @given(st.dictionaries(_NAMES, _VALUES, max_size=24))
    def check(pod_env: dict[str, str]) -> None:
        assert all(env_reserved(name) for name in pod_env)
        env = applied(pod_env, spec)
        for index in range(INDEXES):
            memory, cores = hami_limits(env, index)
            assert memory is not None and memory <= 2048 * MIB, (index, env)
            assert cores is not None and cores <= 30, (index, env)
        assert {name: env[name] for name in NEUTRAL} == NEUTRAL, env

    check()
