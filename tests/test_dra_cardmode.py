"""Card mode ``dra``: such a card is in none of the device plugin's lists (the DRA part
publishes it), and the cards for the DRA part are exactly those."""

from __future__ import annotations

import pytest
from conftest import Node, gpu_uuid
from test_exclusion import card_of, gpu, start

from gpushare.config import ConfigError, load_settings
from gpushare.gpu.gpus import Gpu
from gpushare.share.cardmodes import CardMode, card_modes, dra_cards, parse_card_modes


def test_a_dra_card_is_in_no_device_plugin_list(node: Node) -> None:
    start(node, 3, card_modes=f"0=dra,{gpu_uuid(1)}=shared")
    assert list(node.kubelet.devices(gpu(node))) == [gpu_uuid(2)]
    assert {card_of(d) for d in node.kubelet.devices(node.memory)} == {gpu_uuid(1), gpu_uuid(2)}
    assert {card_of(d) for d in node.kubelet.devices(node.core)} == {gpu_uuid(1), gpu_uuid(2)}


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
