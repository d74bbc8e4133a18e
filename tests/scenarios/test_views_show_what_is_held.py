"""Never show something untrue: what inspect and the metrics show is what the node holds.

A node with a card in MIG mode (mixed), a card offered both ways and a whole-only card,
served to the kubelet stand-in over real sockets, publishing to the API-server double;
``kubectl gpushare inspect`` and the metrics then read what the daemon published:

* a card held whole shows as held, by which container, not as UNHEALTHY;
* MIG devices are listed under their card; the card count matches ``gpu.count``;
* an opted-in node whose daemon never published is listed ("no daemon report"), and
  the cluster line counts it apart;
* whole-card and MIG allocations are exported per card and per pod, and the pods are
  annotated like shared ones; ``gpushare_gpu_healthy`` agrees with inspect.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

from conftest import NODE, RTX_3090, TESLA_P4, Node, gpu_uuid
from kit.kube_double import KubeApiDouble
from kit.mig_layouts import mig_uuid, reference_a100
from kit.procs import daemon_samples, free_port
from test_node_api import add_pod, eventually, node_annotation

from gpushare.daemon import Daemon
from gpushare.kube.kubectlapi import Cluster
from gpushare.ops import inspect

PREFIX = "gpushare.io"
WHOLE = f"{PREFIX}/gpu"
MIG_3G = f"{PREFIX}/mig-3g.20gb"


def start(node: Node, gpus: list[dict[str, Any]], **overrides: Any) -> Daemon:
    node.write_gpus(gpus)
    node.settings = replace(node.settings, **overrides)
    node.kubelet.start()
    node.daemon = Daemon(node.settings, specs=node.specs)
    node.daemon.start()
    return node.daemon


def admit(node: Node, api: KubeApiDouble, name: str, requests: dict[str, int]) -> Any:
    add_pod(api, node, name, requests)
    return node.kubelet.admit(name, "main", requests)


def inspected() -> inspect.ClusterView:
    """What ``kubectl gpushare inspect`` shows (the daemon's logs share stdout: the
    view is built by the command's own functions from the same API reads)."""
    return inspect.build_view(*inspect.fetch(None, Cluster()), PREFIX)


def test_whole_and_mig_holds_are_shown_counted_exported_and_annotated(
    node: Node, api: KubeApiDouble
) -> None:
    gpus = [
        reference_a100(index=0),
        {"uuid": gpu_uuid(1), **RTX_3090, "index": 1},
        {"uuid": gpu_uuid(2), **TESLA_P4, "index": 2},
    ]
    start(
        node,
        gpus,
        node_name=NODE,
        mig_strategy="mixed",
        whole_cards=True,
        card_modes=f"{gpu_uuid(2)}=exclusive",
        metrics_port=free_port(),
        metrics_address="127.0.0.1",
    )
    assert node.kubelet.wait_for(
        lambda k: k.healthy_count(WHOLE) == 2 and k.healthy_count(MIG_3G) == 1
    )
    eventually(lambda: node_annotation(api))
    # the opted-in node whose daemon never published
    opted_in = {"name": "gpu-silent", "labels": {f"{PREFIX}/enabled": "true"}}
    api.add({"apiVersion": "v1", "kind": "Node", "metadata": opted_in})
    first = admit(node, api, "w1", {WHOLE: 1})
    second = admit(node, api, "w2", {WHOLE: 1})
    mig = admit(node, api, "m", {MIG_3G: 1})
    assert {first.card(), second.card()} == {gpu_uuid(1), gpu_uuid(2)}
    assert mig.card() == mig_uuid(0)
    holder = {first.card(): "default/w1/main", second.card(): "default/w2/main"}

    # every pod is annotated with what it got, as shared ones are
    for name, record in (("w1", first), ("w2", second), ("m", mig)):
        eventually(
            lambda n=name, r=record: (
                (api.get("Pod", n, "default")["metadata"].get("annotations") or {}).get(
                    f"{PREFIX}/gpu.main"
                )
                == r.card()
            )
        )

    def published() -> Any:
        state = node_annotation(api)
        return state if state and state.whole and state.whole[0].mig[0].held_by else None

    state = eventually(published)
    (shared_card,) = state.cards
    assert shared_card.uuid == gpu_uuid(1)
    assert not shared_card.healthy  # its units are not offered while it is held whole
    assert shared_card.hardware_healthy and shared_card.held_by == holder[gpu_uuid(1)]

    view = inspected()
    data = json.loads(inspect.render_json(view))
    by_name = {n["name"]: n for n in data["nodes"]}
    silent, ours = by_name["gpu-silent"], by_name[NODE]
    assert silent["problem"].startswith("no daemon report")
    labels = api.get("Node", NODE)["metadata"]["labels"]
    assert ours["cardCount"] == int(labels[f"{PREFIX}/gpu.count"]) == 3
    (card1,) = ours["gpus"]
    assert card1["healthy"] and card1["heldBy"] == holder[gpu_uuid(1)]
    a100, p4 = ours["wholeGpus"]
    assert p4["uuid"] == gpu_uuid(2) and p4["heldBy"] == holder[gpu_uuid(2)]
    assert a100["uuid"] == gpus[0]["uuid"]
    devices = {d["uuid"]: d for d in a100["mig"]}
    assert len(devices) == 4 and devices[mig_uuid(0)]["heldBy"] == "default/m/main"
    assert devices[mig_uuid(0)]["resource"] == MIG_3G
    assert not any(d["heldBy"] for u, d in devices.items() if u != mig_uuid(0))
    assert data["totals"]["unreportedNodes"] == 1 and data["totals"]["nodes"] == 2
    assert data["totals"]["cards"] == 3 and data["totals"]["heldWhole"] == 3

    table = inspect.render_table(view)
    assert "UNHEALTHY" not in table
    assert f"held whole by {holder[gpu_uuid(1)]}" in table
    assert "MIG 3g.20gb" in table and "held by default/m/main" in table
    assert f"NODE {NODE}  (3 cards," in table
    assert "NODE gpu-silent: no daemon report" in table
    assert (
        "CLUSTER  2 nodes (1 reporting, 1 no daemon report), 3 cards (3 healthy, 3 held whole)"
        in table
    )

    # metrics: what each pod holds whole, per card; health of every card as inspect shows it
    devices_held = {
        (s["pod"], s["gpu"], s["device"], s["resource"])
        for s in daemon_samples(node, "gpushare_container_devices")
        if s["value"] == 1
    }
    assert devices_held == {
        ("w1", first.card(), first.card(), WHOLE),
        ("w2", second.card(), second.card(), WHOLE),
        ("m", gpus[0]["uuid"], mig_uuid(0), MIG_3G),
    }
    healthy = {s["gpu"]: s["value"] for s in daemon_samples(node, "gpushare_gpu_healthy")}
    shown = {c["uuid"]: c["healthy"] for c in [card1, a100, p4]}
    assert healthy == {uuid: 1.0 if ok else 0.0 for uuid, ok in shown.items()}
    mig_health = daemon_samples(node, "gpushare_mig_device_healthy")
    assert {s["device"] for s in mig_health} == set(devices)
