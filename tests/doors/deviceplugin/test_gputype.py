"""use-gputype / nouse-gputype / use-gpuuuid / nouse-gpuuuid, in the daemon's placement."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import NODE, Node, gpu_uuid
from hypothesis import given
from hypothesis import strategies as st
from kit.extender import args, card, container, extender_factory, kept, node  # noqa: F401
from kit.extender import pod as extender_pod
from kit.kube_double import KubeApiDouble
from kit.procs import poll

from gpushare.kube import nodestate
from gpushare.share.gputype import CardChoice, ChoiceBook, allowed_cards, card_choice
from gpushare.sim.kubeletdouble import AdmissionError

T4 = {"uuid": gpu_uuid(0), "name": "Tesla T4", "memory_mib": 15360, "numa_node": 0}
A100 = {"uuid": gpu_uuid(1), "name": "NVIDIA A100-PCIE-40GB", "memory_mib": 40960, "numa_node": 0}


# ------------------------------------------------------------------ the pure rule


def test_both_spellings_are_read_joined_and_case_folded() -> None:
    choice = card_choice(
        {
            "gpushare.io/use-gputype": "A100, h100",
            "nvidia.com/use-gputype": "a100,V100",
            "nvidia.com/nouse-gputype": "PCIE",
            "gpushare.io/use-gpuuuid": f"{gpu_uuid(1).upper()}",
            "nvidia.com/nouse-gpuuuid": " , ",
            "other.io/use-gputype": "T4",
        },
        "gpushare.io",
    )
    assert choice == CardChoice(
        use_types=("a100", "h100", "v100"),
        nouse_types=("pcie",),
        use_uuids=(gpu_uuid(1).lower(),),
    )
    assert not choice.allows("NVIDIA A100-PCIE-40GB", gpu_uuid(1))  # nouse PCIE
    assert choice.allows("NVIDIA A100-SXM4-80GB", gpu_uuid(1))
    assert not choice.allows("NVIDIA A100-SXM4-80GB", gpu_uuid(2))  # not the UUID asked for
    assert "use-gputype=a100,h100,v100" in choice.why_not("T4", gpu_uuid(0))


def test_no_annotation_is_no_choice() -> None:
    assert not card_choice({}, "gpushare.io")
    assert not card_choice(None, "gpushare.io")
    assert card_choice({"nvidia.com/use-gputype": 5}, "x.io") == CardChoice()


@given(st.text(max_size=20), st.text(max_size=20), st.lists(st.text(max_size=8), max_size=3))
def test_nouse_always_wins_over_use(name: str, uuid: str, types: list[str]) -> None:
    text = ",".join(types)
    choice = card_choice({"nvidia.com/use-gputype": text, "nvidia.com/nouse-gputype": text}, "x")
    if choice.use_types:
        assert not choice.allows(name, uuid)


def pod(
    name: str,
    limits: dict[str, int],
    annotations: dict[str, str] | None = None,
    phase: str = "Pending",
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default", "annotations": annotations or {}},
        "spec": {
            "containers": [
                {"name": "main", "resources": {"limits": {k: str(v) for k, v in limits.items()}}}
            ]
        },
        "status": {"phase": phase},
    }


def test_the_book_answers_only_when_every_candidate_agrees() -> None:
    book = ChoiceBook("gpushare.io", ["gpushare.io/gpu"])
    a100 = {"nvidia.com/use-gputype": "a100"}
    book.replace_all(
        [
            pod("a", {"gpushare.io/gpu": 2}, a100),
            pod("b", {"gpushare.io/gpu": 1}, a100),
            pod("c", {"gpushare.io/gpu": 1}),
            pod("d", {"gpushare.io/gpu": 4}, a100, phase="Running"),
        ]
    )
    nobody = lambda _key: False  # noqa: E731
    assert book.choice_for("gpushare.io/gpu", 2, nobody) == CardChoice(use_types=("a100",))
    assert book.choice_for("gpushare.io/gpu", 1, nobody) is None  # b or c: cannot tell
    assert book.choice_for("gpushare.io/gpu", 1, lambda k: k[1] == "c") is not None
    assert book.choice_for("gpushare.io/gpu", 4, nobody) is None  # running pods are done
    misses = []
    book.on_miss = lambda: misses.append(1) or False
    assert book.choice_for("gpushare.io/gpu", 3, nobody) is None and misses == [1]


# ------------------------------------------------------------------ in the daemon


def start(node: Node, api: KubeApiDouble) -> None:
    node.start([T4, A100], node_name=NODE, whole_cards=True)
    assert poll(
        lambda: (
            nodestate.annotation_key("gpushare.io")
            in (api.get("Node", NODE)["metadata"].get("annotations") or {})
        ),
        15.0,
    )
    # The whole-card resource registers on its own, after the two shared ones.
    assert node.kubelet.wait_for(lambda k: k.healthy_count("gpushare.io/gpu") == 2, 30.0)


def add(api: KubeApiDouble, name: str, limits: dict[str, int], annotations: dict[str, str]) -> None:
    body = pod(name, limits, annotations)
    body["spec"]["nodeName"] = NODE
    body["apiVersion"], body["kind"] = "v1", "Pod"
    api.add(body)


def known(node: Node, name: str) -> bool:
    """Wait until the daemon has read the pod (as a pod list right after it was bound)."""
    daemon = node.daemon
    assert daemon is not None and daemon.core is not None
    assert daemon.core.api_link is not None and daemon.core.choices is not None
    link, book = daemon.core.api_link, daemon.core.choices

    def read() -> bool:
        if book.knows("default", name):
            return True
        link.refresh_pods_now()  # rate-limited; the next look may find it
        return False

    return poll(read, 30.0)


def recorded(node: Node, pod_name: str) -> bool:
    """Wait until the daemon's last read of the kubelet's records shows the pod."""
    daemon = node.daemon
    assert daemon is not None and daemon.core is not None
    refresher, client = daemon.core.refresher, daemon.core.pod_resources

    def read() -> bool:
        refresher.refresh_once()
        last = client.last
        held = [h for ids in last.exclusive.values() for h in ids.values()] if last else []
        return any(h.pod == pod_name for h in held)

    return poll(read, 30.0)


def test_shared_units_go_to_the_card_type_the_pod_names(node: Node, api: KubeApiDouble) -> None:
    start(node, api)
    add(api, "plain", {node.memory: 3}, {})
    assert node.kubelet.admit("plain", "main", {node.memory: 3}).card() == gpu_uuid(0)  # binpack
    add(api, "picky", {node.memory: 5}, {"nvidia.com/use-gputype": "a100"})
    assert known(node, "picky")
    assert node.kubelet.admit("picky", "main", {node.memory: 5}).card() == gpu_uuid(1)
    add(api, "avoid", {node.memory: 7}, {"gpushare.io/nouse-gputype": "A100"})
    assert known(node, "avoid")
    assert node.kubelet.admit("avoid", "main", {node.memory: 7}).card() == gpu_uuid(0)


def test_whole_cards_follow_uuid_and_type_choices(node: Node, api: KubeApiDouble) -> None:
    start(node, api)
    add(api, "by-uuid", {"gpushare.io/gpu": 1}, {"nvidia.com/use-gpuuuid": gpu_uuid(1)})
    assert known(node, "by-uuid")
    admitted = node.kubelet.admit("by-uuid", "main", {"gpushare.io/gpu": 1})
    assert admitted.devices["gpushare.io/gpu"] == [gpu_uuid(1)]
    assert recorded(node, "by-uuid")  # so it is not a candidate for the next admission
    # The only card left is a T4: a pod that refuses T4s is not given it.
    add(api, "no-t4", {"gpushare.io/gpu": 1}, {"nvidia.com/nouse-gputype": "t4"})
    assert known(node, "no-t4")
    with pytest.raises(AdmissionError, match="exclude"):
        node.kubelet.admit("no-t4", "main", {"gpushare.io/gpu": 1})


def test_allowed_cards_for_the_extender() -> None:
    cards = [(gpu_uuid(0), "Tesla T4"), (gpu_uuid(1), "NVIDIA A100-PCIE-40GB")]
    assert card_allowed(pod("p", {}), cards) is None
    picky = pod("p", {}, {"gpushare.io/nouse-gputype": "t4"})
    assert card_allowed(picky, cards) == {gpu_uuid(1)}
    none_left = pod("p", {}, {"nvidia.com/use-gpuuuid": gpu_uuid(7)})
    assert card_allowed(none_left, cards) == set()


def card_allowed(body: dict[str, Any], cards: list[tuple[str, str]]) -> set[str] | None:
    return allowed_cards(body, "gpushare.io", cards)


# ------------------------------------------------------------------ in the scheduler extender


def test_the_extender_filters_nodes_by_the_pods_card_choice(
    extender_factory: Any,  # noqa: F811 (the fixture of test_extender)
) -> None:
    t4 = node("t4-node", [card(0, name="Tesla T4")])
    mixed = node("mixed", [card(0, name="Tesla T4"), card(1, 10, name="NVIDIA A100-PCIE-40GB")])
    server = extender_factory()
    wants = extender_pod("wants-a100", container("main", memory=4))
    wants["metadata"]["annotations"] = {"nvidia.com/use-gputype": "a100"}
    answer = server.filter(args(wants, t4, mixed))
    assert kept(answer) == ["mixed"]
    assert answer["FailedNodes"] == {
        "t4-node": "the pod's card choice excludes every card: GPU0 (Tesla T4)"
    }
    # the only allowed card is too full (the T4 would hold it): the reason says so
    big = extender_pod("big-a100", container("main", memory=8))
    big["metadata"]["annotations"] = {"gpushare.io/use-gputype": "A100"}
    reason = server.filter(args(big, mixed))["FailedNodes"]["mixed"]
    assert "excluded by the pod's card choice: GPU0 (Tesla T4)" in reason
    # without a choice both nodes stay
    plain = extender_pod("plain", container("main", memory=4))
    assert kept(server.filter(args(plain, t4, mixed))) == ["t4-node", "mixed"]
