"""Card mode ``dra``: such a card is in none of the device plugin's lists (the DRA part
publishes it), and the cards for the DRA part are exactly those."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest
from conftest import NODE, TESLA_P4, Node, cards, gpu_uuid
from kit.mig_layouts import A100_UUID, mig_uuid, reference_a100, uniform_a100
from kit.procs import poll
from test_exclusion import card_of, gpu, start
from test_mig_serving import registered
from test_mig_serving import start as start_mig

from gpushare.base.startup import NodeConfigurationError
from gpushare.config import ConfigError, load_settings
from gpushare.daemon import Daemon
from gpushare.gpu.gpus import Gpu
from gpushare.kube import nodestate
from gpushare.share.cardmodes import CardMode, card_modes, dra_cards, parse_card_modes
from gpushare.sim.apidouble import KubeApiDouble
from gpushare.sim.drakubeletdouble import DraKubelet, allocated_claim


def test_a_dra_card_is_in_the_slice_and_in_no_device_plugin_list(
    node: Node, api: KubeApiDouble
) -> None:
    start(
        node,
        3,
        card_modes=f"0=dra,{gpu_uuid(1)}=shared",
        node_name=NODE,
        dra_kubelet_root=str(node.root / "kubelet"),
        dra_cdi_dir=str(node.root / "cdi"),
    )
    daemon = node.daemon
    assert daemon is not None
    # no slice before the kubelet has registered the plugin (issue 32.19)
    assert poll(lambda: "register the DRA plugin" in daemon.readiness()[1], 30)
    assert slices(api) == []
    register_dra(node)
    assert list(node.kubelet.devices(gpu(node))) == [gpu_uuid(2)]
    assert {card_of(d) for d in node.kubelet.devices(node.memory)} == {gpu_uuid(1), gpu_uuid(2)}
    assert {card_of(d) for d in node.kubelet.devices(node.core)} == {gpu_uuid(1), gpu_uuid(2)}

    def slice_devices() -> list[str]:
        found = api.get(
            "ResourceSlice", f"{NODE}-gpu.gpushare.io-0", api_version="resource.k8s.io/v1"
        )
        return [d["name"] for d in (found or {}).get("spec", {}).get("devices", [])]

    assert poll(lambda: slice_devices() == ["gpu-0"], 30)
    attributes = api.get(
        "ResourceSlice", f"{NODE}-gpu.gpushare.io-0", api_version="resource.k8s.io/v1"
    )
    assert attributes is not None
    (device,) = attributes["spec"]["devices"]
    assert device["attributes"]["uuid"] == {"string": gpu_uuid(0)}
    assert poll(lambda: "dra" not in daemon.readiness()[1], 30)
    kubelet = DraKubelet(node.root / "kubelet")
    assert kubelet.register() == "v1.DRAPlugin"
    kubelet.close()


def test_dra_cards_without_an_api_server_are_refused_in_one_line(node: Node) -> None:
    node.write_gpus(cards(TESLA_P4, 2))
    node.kubelet.start()
    node.settings = replace(node.settings, card_modes="1=dra", node_name="")
    with pytest.raises(NodeConfigurationError, match="card mode dra: ") as caught:
        Daemon(node.settings).start()
    assert "\n" not in str(caught.value)


def test_dra_mode_parses_and_selects_the_cards() -> None:
    modes = parse_card_modes("0=dra,1=DRA")
    assert set(modes.values()) == {CardMode.DRA}
    assert not CardMode.DRA.shared and not CardMode.DRA.exclusive
    gpus = [Gpu(f"GPU-{i}", "T4", 15360, i, i) for i in range(3)]
    by_uuid = card_modes(gpus, modes)
    assert [g.uuid for g in dra_cards(gpus, by_uuid)] == ["GPU-0", "GPU-1"]
    assert by_uuid["GPU-2"] is CardMode.BOTH


def test_a_bad_driver_name_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="dra_driver") as caught:
        load_settings(["--dra-driver=Not_A.Domain"], {})
    assert "\n" not in str(caught.value)
    assert load_settings([], {}).dra_driver == "gpu.gpushare.io"


def test_shared_units_are_admitted_beside_a_dra_card(node: Node, api: KubeApiDouble) -> None:
    """Without whole cards the device plugin's offer is the cards' own health board, which
    holds the DRA card too: its placement must look at its own cards only (found by the
    e2e comparison run: every GetPreferredAllocation failed with a KeyError)."""
    node.start(
        cards(TESLA_P4, 2),
        card_modes="0=dra",
        node_name=NODE,
        dra_kubelet_root=str(node.root / "kubelet"),
        dra_cdi_dir=str(node.root / "cdi"),
    )
    admitted = node.kubelet.admit("p", "main", {node.memory: 4, node.core: 30})
    assert {card_of(d) for ids in admitted.devices.values() for d in ids} == {gpu_uuid(1)}


# ------------------------------------------------------------------ a card in MIG mode


def _slice_devices(api: KubeApiDouble) -> list[str]:
    found = api.get("ResourceSlice", f"{NODE}-gpu.gpushare.io-0", api_version="resource.k8s.io/v1")
    return [d["name"] for d in (found or {}).get("spec", {}).get("devices", [])]


def slices(api: KubeApiDouble) -> list[str]:
    return [key for key in api.objects if "/resourceslices/" in key]


def register_dra(node: Node) -> None:
    """Register the DRA plugin as the kubelet's plugin watcher does."""
    kubelet = DraKubelet(node.root / "kubelet")
    assert poll(lambda: bool(kubelet.registration_sockets()), 30)
    kubelet.register()
    kubelet.close()


def _start_mig_node(node: Node, modes: str, **overrides: Any) -> Daemon:
    daemon = start_mig(
        node,
        [reference_a100(), cards(TESLA_P4, 2)[1]],
        card_modes=modes,
        mig_strategy="mixed",
        node_name=NODE,
        dra_kubelet_root=str(node.root / "kubelet"),
        dra_cdi_dir=str(node.root / "cdi"),
        **overrides,
    )
    register_dra(node)
    return daemon


def test_a_mig_card_in_dra_mode_leaves_the_mig_plan_and_its_devices_are_in_the_slice(
    node: Node, api: KubeApiDouble
) -> None:
    daemon = _start_mig_node(node, "0=dra")
    # the device plugin serves the shared card only: no MIG resource at all
    assert not [name for name in registered(node) if "/mig-" in name]
    assert not daemon.core.found.mig_plan.mig_devices
    assert poll(lambda: len(_slice_devices(api)) == 4, 30)
    assert sorted(_slice_devices(api)) == [
        "gpu-0-mig-10-0",
        "gpu-0-mig-2-0",
        "gpu-0-mig-3-0",
        "gpu-0-mig-9-0",
    ]
    kubelet = DraKubelet(node.root / "kubelet")
    kubelet.register()
    claim = api.add(
        allocated_claim(
            "default", "small", "gpu.gpushare.io", NODE,
            [{"request": "mig", "device": "gpu-0-mig-9-0"}],
        )
    )
    ref = ("default", "small", claim["metadata"]["uid"])
    (answer,) = kubelet.prepare([ref]).values()
    kubelet.close()
    assert answer.error == ""
    spec = json.loads(
        (node.root / "cdi" / f"gpu.gpushare.io-claim_{ref[2]}.json").read_text()
    )
    env = dict(e.split("=", 1) for e in spec["devices"][0]["containerEdits"]["env"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == mig_uuid(2)  # the 1g.5gb at GPU instance 9
    assert "CUDA_DEVICE_MEMORY_LIMIT_0" not in env  # a MIG device is whole: no interposer
    # the card still counts on the node (gpu.count) and is shown under its index
    assert poll(lambda: A100_UUID in _whole_uuids(api), 30)
    # ...with the claim prepared on its MIG device (the device's memory, no core limit)
    assert poll(lambda: _dra_claims(api).get(A100_UUID) == [["small", "gpu-0-mig-9-0", 0]], 30)
    mib = next(d.memory_mib for d in daemon.core.found.dra_mig_cards[0].mig_devices
               if d.uuid == mig_uuid(2))  # fmt: skip
    assert _dra_claims(api, "memory_mib")[A100_UUID] == [["small", "gpu-0-mig-9-0", mib]]
    # its published total is its MIG devices' memory, and no cores; inspect shows that
    state = nodestate.decode(
        (api.get("Node", NODE) or {})["metadata"]["annotations"]["gpushare.io/gpus"]
    )
    (a100,) = [w for w in state.whole if w.uuid == A100_UUID]
    instances = reference_a100()["instances"]
    assert (a100.memory_total_mib, a100.cores_total) == (
        sum(i["memory_mib"] for i in instances),
        0,
    )
    assert (a100.dra_memory_total(256), a100.dra_cores_total()) == (
        a100.memory_total_mib,
        0,
    )


def _dra_claims(api: KubeApiDouble, figure: str = "cores") -> dict[str, list[list[Any]]]:
    """Card UUID -> [claim, device, figure] of each DRA card's published claims."""
    found = api.get("Node", NODE) or {}
    text = found.get("metadata", {}).get("annotations", {}).get("gpushare.io/gpus")
    cards = json.loads(text).get("wholeGpus", []) if text else []
    return {
        c["uuid"]: [[x["claim"], x["device"], x[figure]] for x in c["claims"]]
        for c in cards
        if c.get("mode") == "dra"
    }


def _whole_uuids(api: KubeApiDouble) -> set[str]:
    found = api.get("Node", NODE) or {}
    text = found.get("metadata", {}).get("annotations", {}).get("gpushare.io/gpus")
    if not text:
        return set()
    return {card["uuid"] for card in json.loads(text).get("wholeGpus", [])}


def test_a_mig_card_without_a_mode_stays_with_the_device_plugin(
    node: Node, api: KubeApiDouble
) -> None:
    daemon = _start_mig_node(node, "1=dra")
    assert {name for name in registered(node) if "/mig-" in name} == {
        "gpushare.io/mig-3g.20gb",
        "gpushare.io/mig-2g.10gb",
        "gpushare.io/mig-1g.5gb",
    }
    assert len(daemon.core.found.mig_plan.mig_devices) == 4
    assert poll(lambda: _slice_devices(api) == ["gpu-1"], 30)


@pytest.mark.parametrize("mode", ["shared", "exclusive"])
def test_a_mig_card_in_a_device_plugin_mode_is_refused_in_one_line(
    node: Node, api: KubeApiDouble, mode: str
) -> None:
    with pytest.raises(NodeConfigurationError, match="in MIG mode") as caught:
        _start_mig_node(node, f"{A100_UUID}={mode}")
    assert "\n" not in str(caught.value)


def test_single_strategy_looks_only_at_the_mig_cards_it_serves(
    node: Node, api: KubeApiDouble
) -> None:
    """The reference A100 (three profiles) would make ``single`` refuse the node; in
    ``dra`` mode it is the DRA driver's, and the uniform card is served as ``gpu``."""
    start_mig(
        node,
        [reference_a100(), uniform_a100("GPU-uniform-a100", 1, 16)],
        card_modes="0=dra",
        mig_strategy="single",
        node_name=NODE,
        dra_kubelet_root=str(node.root / "kubelet"),
        dra_cdi_dir=str(node.root / "cdi"),
    )
    register_dra(node)
    assert node.kubelet.wait_for(lambda k: k.healthy_count("gpushare.io/gpu") == 7)
    assert poll(lambda: len(_slice_devices(api)) == 4, 30)


def _tainted(api: KubeApiDouble) -> list[str]:
    found = api.get("ResourceSlice", f"{NODE}-gpu.gpushare.io-0", api_version="resource.k8s.io/v1")
    devices = (found or {}).get("spec", {}).get("devices", [])
    return sorted(d["name"] for d in devices if d.get("taints"))


def test_a_mig_device_of_a_dra_card_is_tainted_alone_and_refused(
    node: Node, api: KubeApiDouble
) -> None:
    """An XID naming one GPU instance, and a destroyed MIG device, reach that device's
    slice entry and its prepares alone (found by review: both were lost, or hit every
    MIG device of the card); an XID on the card reaches all of them."""
    _start_mig_node(node, "0=dra", ignored_xids="13")
    assert poll(lambda: len(_slice_devices(api)) == 4, 30)
    assert _tainted(api) == []
    card = reference_a100()
    card["instances"][2]["xid"] = 79  # gi 9: the first 1g.5gb
    node.write_gpus([card, cards(TESLA_P4, 2)[1]])
    assert poll(lambda: _tainted(api) == ["gpu-0-mig-9-0"], 30)
    kubelet = DraKubelet(node.root / "kubelet")
    kubelet.register()
    refs = []
    for name, device in (("sick", "gpu-0-mig-9-0"), ("fine", "gpu-0-mig-10-0")):
        obj = api.add(
            allocated_claim(
                "default", name, "gpu.gpushare.io", NODE, [{"request": "mig", "device": device}]
            )
        )
        refs.append(("default", name, obj["metadata"]["uid"]))
    answers = kubelet.prepare(refs)
    kubelet.close()
    assert "unhealthy" in answers[refs[0][2]].error
    assert answers[refs[1][2]].error == ""
    del card["instances"][0]  # the 3g.20gb instance is destroyed
    node.write_gpus([card, cards(TESLA_P4, 2)[1]])
    assert poll(lambda: _tainted(api) == ["gpu-0-mig-2-0", "gpu-0-mig-9-0"], 30)
    card["xid"] = 48  # the whole card
    node.write_gpus([card, cards(TESLA_P4, 2)[1]])
    assert poll(lambda: len(_tainted(api)) == 4, 30)
