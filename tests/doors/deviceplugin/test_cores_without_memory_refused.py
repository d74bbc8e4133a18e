"""A container asking cores and no memory units is refused by the daemon.

``vcuda-memory: 0`` is skipped by the kubelet (a zero quantity is no request), so only
the core Allocate reaches the daemon: answered, the container would run with no memory
limit on a card whose memory units are all still given to its neighbours. The admission
policy is the first wall (``test_policies.py``); the daemon is the second, from its pod
specs: real gRPC over unix sockets, the kubelet stand-in admitting as the kubelet does.
"""

from __future__ import annotations

import pytest
from conftest import TESLA_P4, Node, cards

from gpushare.sim.kubeletdouble import AdmissionError


@pytest.mark.parametrize("memory", [0, None])
def test_a_core_allocate_for_a_container_asking_no_memory_is_refused_with_what_to_add(
    node: Node, memory: int | None
) -> None:
    node.with_pod_specs()
    node.start(cards(TESLA_P4, 1))
    node.pod("neighbour", {node.memory: 29})
    assert node.kubelet.admit("neighbour", "main", {node.memory: 29}).card()
    spec = {node.core: 50} if memory is None else {node.core: 50, node.memory: memory}
    node.pod("greedy", spec)
    with pytest.raises(AdmissionError) as refused:
        node.kubelet.admit("greedy", "main", spec)
    message = str(refused.value)
    assert "container main of pod default/greedy" in message
    assert f"add {node.memory} of 1 or more" in message
    assert "\n" not in message
    # Nothing of it is held; the neighbour keeps its card's memory.
    assert node.kubelet.admitted.keys() == {("default", "neighbour", "main")}


@pytest.mark.parametrize("core_first", [True, False])
def test_a_container_asking_both_is_served_in_either_order(node: Node, core_first: bool) -> None:
    node.with_pod_specs()
    node.start(cards(TESLA_P4, 2))
    for i in range(3):  # core-first after other pods too
        requests = {node.core: 30, node.memory: 4}
        node.pod(f"both{i}", requests)
        order = [node.core, node.memory] if core_first else [node.memory, node.core]
        record = node.kubelet.admit(f"both{i}", "main", requests, order=order)
        assert record.envs["CUDA_DEVICE_SM_LIMIT"] == "30"
        assert record.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1024m"
