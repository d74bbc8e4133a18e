"""gpushare.bench.scaleobjects: make scale's Node carries the daemon's card state that
the extender reads (8 cards, the pods counted), and its pod template filled in is the
same pod as the one built directly."""

from __future__ import annotations

import json

from gpushare.bench import scaleobjects
from gpushare.extender.nodecache import record_of


def test_a_gpu_node_is_read_by_the_extender_as_eight_cards() -> None:
    node = scaleobjects.gpu_node(12)
    assert node["metadata"]["name"] == scaleobjects.node_name(12) == "node-00012"
    record = record_of(node, scaleobjects.PREFIX)
    assert record.code == "fits" and record.state is not None
    assert [c.uuid for c in record.state.cards] == [
        scaleobjects.card_uuid(12, c) for c in range(scaleobjects.CARDS)
    ]
    assert [c.memory_units_used for c in record.state.cards][:4] == [0, 64, 128, 192]


def test_the_template_filled_in_is_the_pod_built_directly() -> None:
    for gpu in (False, True):
        fields = scaleobjects.pod_fields(1234, nodes=100)
        pod = json.loads(scaleobjects.POD_TEXT[gpu] % fields)
        direct = scaleobjects.a_pod(1234, gpu, fields["node"], fields["card"])
        direct["metadata"]["resourceVersion"] = fields["rv"]
        assert pod["metadata"]["name"] == direct["metadata"]["name"] == "pod-001234"
        assert pod["spec"] == direct["spec"]
        assert pod["metadata"]["annotations"] == direct["metadata"]["annotations"]


def test_a_pending_pod_asks_its_units_and_is_unbound() -> None:
    pod = scaleobjects.pending_pod(3, memory_units=8)
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits[f"{scaleobjects.PREFIX}/vcuda-memory"] == "8"
    assert pod["status"] == {"phase": "Pending"} and pod["metadata"]["annotations"] == {}
