"""Card mode ``dra``: such a card is in none of the device plugin's lists (the DRA part
publishes it), and the cards for the DRA part are exactly those."""

from __future__ import annotations

from dataclasses import replace

import pytest
from conftest import NODE, TESLA_P4, Node, cards, gpu_uuid
from procs import poll
from test_exclusion import card_of, gpu, start

from gpushare.base.startup import NodeConfigurationError
from gpushare.config import ConfigError, load_settings
from gpushare.daemon import Daemon
from gpushare.gpu.gpus import Gpu
from gpushare.share.cardmodes import CardMode, card_modes, dra_cards, parse_card_modes
from gpushare.sim.apiserver import KubeApiDouble
from gpushare.sim.drakubelet import DraKubelet


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
    assert list(node.kubelet.devices(gpu(node))) == [gpu_uuid(2)]
    assert {card_of(d) for d in node.kubelet.devices(node.memory)} == {gpu_uuid(1), gpu_uuid(2)}
    assert {card_of(d) for d in node.kubelet.devices(node.core)} == {gpu_uuid(1), gpu_uuid(2)}
    daemon = node.daemon
    assert daemon is not None

    def slice_devices() -> list[str]:
        found = api.get(
            "ResourceSlice", f"{NODE}-gpu.gpushare.io-0", api_version="resource.k8s.io/v1"
        )
        return [d["name"] for d in (found or {}).get("spec", {}).get("devices", [])]

    assert poll(lambda: slice_devices() == ["gpu-0"], 10)
    attributes = api.get(
        "ResourceSlice", f"{NODE}-gpu.gpushare.io-0", api_version="resource.k8s.io/v1"
    )
    assert attributes is not None
    (device,) = attributes["spec"]["devices"]
    assert device["attributes"]["uuid"] == {"string": gpu_uuid(0)}
    assert poll(lambda: "dra" not in daemon.readiness()[1], 10)
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
