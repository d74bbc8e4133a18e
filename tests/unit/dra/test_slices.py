"""The node's ResourceSlices in the API-server double: published, re-published, read back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import NODE
from structlog.testing import capture_logs
from test_dra_plugin import DRIVER, DraNode, dra, gpu, wait_until

from gpushare.dra import slices as slices_module
from gpushare.sim.apidouble import KubeApiDouble

SLICES = "/apis/resource.k8s.io/v1/resourceslices"


def slices(api: KubeApiDouble) -> list[dict[str, Any]]:
    with api._lock:
        found = [o for k, o in api.objects.items() if k.startswith(SLICES + "/")]
    return sorted(found, key=lambda s: s["metadata"]["name"])


def devices(api: KubeApiDouble) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for s in slices(api) for d in s["spec"]["devices"]}


__all__ = ["dra"]  # fixture (test_dra_plugin's DRA node, stopped after the test)


def published(dra: DraNode) -> bool:
    return dra.part is not None and dra.part.ready()[0]


def test_slices_carry_owner_generation_and_consumable_capacity(dra: DraNode) -> None:
    dra.start()
    assert wait_until(lambda: published(dra))
    (piece,) = slices(dra.api)
    node = dra.api.get("Node", NODE)
    assert node is not None
    (owner,) = piece["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", NODE, node["metadata"]["uid"])
    spec = piece["spec"]
    assert (spec["driver"], spec["nodeName"], spec["pool"]["name"]) == (DRIVER, NODE, NODE)
    assert spec["pool"]["resourceSliceCount"] == 1
    gpu0 = spec["devices"][0]
    assert gpu0["allowMultipleAllocations"] is True
    assert gpu0["capacity"]["memory"]["requestPolicy"]["default"] == "24576Mi"
    assert gpu0["capacity"]["cores"]["requestPolicy"]["default"] == "0"
    # the dry-run probe came first and stored nothing
    posts = dra.api.calls("POST", SLICES)
    assert posts[0].query.get("dryRun") == ["All"]
    assert all(not p.query for p in posts[1:])


def test_republished_after_the_kubelet_deletes_them_with_a_new_generation(dra: DraNode) -> None:
    dra.start()
    assert wait_until(lambda: published(dra))
    first = slices(dra.api)[0]["spec"]["pool"]["generation"]
    writes = dra.part.publisher.writes if dra.part else 0
    assert dra.part is not None and dra.part.publisher.wait_passes(3, 30)
    assert dra.part.publisher.writes == writes  # nothing changed: nothing written
    # the kubelet at its start: DeleteCollection of the node's slices
    dra.client.request("DELETE", SLICES, query={"fieldSelector": f"spec.nodeName={NODE}"})
    assert slices(dra.api) == []
    assert wait_until(lambda: len(slices(dra.api)) == 1)
    assert slices(dra.api)[0]["spec"]["pool"]["generation"] > first


def test_at_most_128_devices_per_slice(short_tmp: Path, api: KubeApiDouble) -> None:
    node = DraNode(short_tmp, api)
    node.gpus = [gpu(i) for i in range(130)]
    from gpushare.gpu.health import HealthBoard

    node.board = HealthBoard(g.uuid for g in node.gpus)
    try:
        node.start()
        assert wait_until(lambda: published(node))
        pieces = slices(api)
        assert [len(s["spec"]["devices"]) for s in pieces] == [128, 2]
        assert {s["spec"]["pool"]["resourceSliceCount"] for s in pieces} == {2}
        assert len({s["spec"]["pool"]["generation"] for s in pieces}) == 1
    finally:
        node.stop()


def test_generation_moves_past_slices_of_an_earlier_daemon(dra: DraNode) -> None:
    dra.start()
    assert wait_until(lambda: published(dra))
    dra.stop()
    old = slices(dra.api)[0]
    old["spec"]["pool"]["generation"] = 41
    old["spec"]["devices"] = old["spec"]["devices"][:1]
    with dra.api._lock:
        dra.api._put(SLICES + "/" + old["metadata"]["name"], old)
    dra.start()
    assert wait_until(lambda: slices(dra.api)[0]["spec"]["pool"]["generation"] == 42)
    assert len(slices(dra.api)[0]["spec"]["devices"]) == 2


def test_unhealthy_card_gets_a_taint_and_back(dra: DraNode) -> None:
    dra.start()
    assert wait_until(lambda: published(dra))
    dra.board.set("GPU-00000001", False, "XID 79")
    assert wait_until(lambda: "taints" in devices(dra.api)["gpu-1"])
    (taint,) = devices(dra.api)["gpu-1"]["taints"]
    assert taint["key"] == f"{DRIVER}/unhealthy" and taint["effect"] == "NoSchedule"
    assert taint["value"] == "XID-79"
    dra.board.set("GPU-00000001", True)
    assert wait_until(lambda: "taints" not in devices(dra.api)["gpu-1"])


def test_without_device_taints_an_unhealthy_card_leaves_the_slice(dra: DraNode) -> None:
    dra.api.device_taints = False
    dra.start()
    assert wait_until(lambda: published(dra))
    dra.board.set("GPU-00000000", False, "lost")
    assert wait_until(lambda: list(devices(dra.api)) == ["gpu-1"])
    dra.board.set("GPU-00000000", True)
    assert wait_until(lambda: list(devices(dra.api)) == ["gpu-0", "gpu-1"])


def test_an_api_server_without_consumable_capacity_is_detected(dra: DraNode) -> None:
    dra.api.consumable_capacity = False
    with capture_logs() as logs:
        dra.start()
        assert dra.part is not None
        assert wait_until(lambda: dra.part is not None and dra.part.publisher.published)
    ready, why = dra.part.ready()
    assert not ready
    assert "DRAConsumableCapacity" in why and "gpu-0" in why
    assert "\n" not in why
    # never a shared card published as a whole one
    assert devices(dra.api) == {}
    (line,) = [e for e in logs if e["event"] == "dra_consumable_capacity_off"]
    assert line["log_level"] == "error"
    # nothing was ever stored with the card in it: the probe was a dry run
    assert all(
        not p.body["spec"]["devices"] or p.query.get("dryRun")
        for p in dra.api.calls("POST", SLICES)
    )


def test_read_back_catches_a_server_that_drops_only_on_real_writes(dra: DraNode) -> None:
    """A server whose dry run keeps the fields but whose stored object lacks them
    (e.g. an aggregated or mutating proxy): the read-back withdraws the cards."""
    original = dra.api._drop_disabled
    calls = {"n": 0}

    def drop_after_probe(body: dict[str, Any]) -> dict[str, Any]:
        calls["n"] += 1
        dra.api.consumable_capacity = calls["n"] <= 1
        return original(body)

    dra.api._drop_disabled = drop_after_probe  # type: ignore[method-assign]
    dra.start()
    assert wait_until(
        lambda: dra.part is not None and "DRAConsumableCapacity" in dra.part.ready()[1]
    )
    assert wait_until(lambda: devices(dra.api) == {})


def test_a_restarted_daemon_rewrites_nothing_that_did_not_change(dra: DraNode) -> None:
    """The slices carry a digest of what was written: a new instance (a restart, or the
    second daemon of a rolling update) finds its own content and leaves it, generation too."""
    dra.start()
    assert wait_until(lambda: published(dra))
    generation = slices(dra.api)[0]["spec"]["pool"]["generation"]
    dra.stop()
    part = dra.start()
    assert part.publisher.wait_passes(3, 30)
    assert part.publisher.writes == 0
    assert slices(dra.api)[0]["spec"]["pool"]["generation"] == generation
    # and when the kubelet deletes them, the new instance's slices are newer still
    dra.client.request("DELETE", SLICES, query={"fieldSelector": f"spec.nodeName={NODE}"})
    assert wait_until(lambda: bool(slices(dra.api)))
    assert slices(dra.api)[0]["spec"]["pool"]["generation"] > generation


# -- what is compared of a slice (gpushare.dra.slices) ---------------------------------


def test_the_shape_is_what_a_server_that_drops_fields_changes() -> None:
    written = [
        {"name": "gpu-0", "allowMultipleAllocations": True, "taints": [{"key": "k"}]},
        {"name": "gpu-1", "capacity": {"memory": {"value": "16Gi"}}},
    ]
    kept = [{"name": "gpu-0"}, {"name": "gpu-1", "capacity": {}}]  # sharing and taints lost
    assert slices_module.shape(written) == [("gpu-0", True, True), ("gpu-1", False, False)]
    assert slices_module.shape(kept) == [("gpu-0", False, False), ("gpu-1", False, False)]
    assert slices_module.shape(written) != slices_module.shape(kept)


def test_the_digest_follows_the_content_not_the_key_order() -> None:
    one = [{"name": "gpu-0", "attributes": {"a": 1, "b": 2}}]
    same = [{"attributes": {"b": 2, "a": 1}, "name": "gpu-0"}]
    other = [{"name": "gpu-0", "attributes": {"a": 1, "b": 3}}]
    digest = slices_module.content_digest(one)
    assert digest == slices_module.content_digest(same) and len(digest) == 64
    assert digest != slices_module.content_digest(other)
    assert slices_module.content_digest([]) != slices_module.content_digest([{}])
