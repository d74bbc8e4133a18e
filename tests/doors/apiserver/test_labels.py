"""GPU-model node labels (GPU feature discovery style) and the per-card type choice."""

from __future__ import annotations

import re
import string
from dataclasses import replace

import pytest
import yaml
from conftest import NODE, TESLA_P4, Node, cards
from hypothesis import given
from hypothesis import strategies as st
from kit.kube_double import KubeApiDouble
from kit.procs import poll

from gpushare.gpu.gpus import Gpu
from gpushare.kube import nodestate
from gpushare.kube.labels import LabelFacts, arch_family, gfd_sanitise, node_labels, product_label

#: What the API server accepts as a label value.
VALID_VALUE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")


@pytest.mark.parametrize(
    ("name", "label"),
    [
        ("NVIDIA A100-PCIE-40GB", "NVIDIA-A100-PCIE-40GB"),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA-A100-SXM4-80GB"),
        ("Tesla P4", "Tesla-P4"),
        ("NVIDIA GeForce RTX 3090 Ti (rev a1)", "NVIDIA-GeForce-RTX-3090-Ti-rev-a1"),
        ("Tesla  V100  ", "Tesla-V100"),  # runs of spaces: one dash, as GFD's strings.Fields
        ("NVIDIA H100 80GB HBM3", "NVIDIA-H100-80GB-HBM3"),
        ("Quadro RTX 6000/8000", "Quadro-RTX-60008000"),  # removed, not replaced
        ("NVIDIA RTX A6000 ™", "NVIDIA-RTX-A6000"),
        ("-.leading and trailing._-", "leading-and-trailing"),
        ("((()))", ""),
        ("", ""),
        ("x" * 80, "x" * 63),
        ("a" * 62 + " -b", "a" * 62),  # cut at 63 would end in '-': trimmed
    ],
)
def test_product_names_are_sanitised_as_gfd_does_and_always_valid(name: str, label: str) -> None:
    assert product_label(name) == label
    assert VALID_VALUE.fullmatch(label)


def test_gfd_sanitise_alone_keeps_what_gfd_keeps() -> None:
    assert gfd_sanitise("  A.b_c-d  e ") == "A.b_c-d-e"


@given(st.text(alphabet=st.characters(), max_size=120))
def test_any_name_gives_a_valid_label_value(name: str) -> None:
    value = product_label(name)
    assert len(value) <= 63 and VALID_VALUE.fullmatch(value)
    assert set(value) <= set(string.ascii_letters + string.digits + "-_.")


@pytest.mark.parametrize(
    ("capability", "family"),
    [
        ((6, 1), "pascal"),
        ((7, 0), "volta"),
        ((7, 5), "turing"),
        ((8, 0), "ampere"),
        ((8, 6), "ampere"),
        ((8, 9), "ada-lovelace"),
        ((9, 0), "hopper"),
        ((10, 0), "blackwell"),
        ((4, 0), "undefined"),
    ],
)
def test_architecture_families(capability: tuple[int, int], family: str) -> None:
    assert arch_family(*capability) == family


def gpu(
    index: int, name: str = "NVIDIA A100-PCIE-40GB", cc: tuple[int, int] | None = (8, 0)
) -> Gpu:
    return Gpu(f"GPU-{index}", name, 40960, index, index, compute_capability=cc)


def test_every_label_from_the_first_card_and_the_driver() -> None:
    persistent = [replace(g, persistence_mode=True) for g in (gpu(1, "Tesla T4", (7, 5)), gpu(0))]
    facts = LabelFacts(gpus=persistent, cuda_driver=(12, 4))
    assert node_labels("gpushare.io", facts) == {
        "gpushare.io/gpu.product": "NVIDIA-A100-PCIE-40GB",
        "gpushare.io/gpu.count": "2",
        "gpushare.io/gpu.memory": "40960",
        "gpushare.io/gpu.family": "ampere",
        "gpushare.io/gpu.compute.major": "8",
        "gpushare.io/gpu.compute.minor": "0",
        "gpushare.io/cuda.driver.major": "12",
        "gpushare.io/cuda.driver.minor": "4",
        "gpushare.io/persistence-mode": "on",
    }
    shown = set(node_labels("gpushare.io", facts))
    enforcement = {k for k in nodestate.label_keys("gpushare.io") if "enforcement" in k}
    assert shown == set(nodestate.label_keys("gpushare.io")) - enforcement


def test_nvidia_product_label_only_when_asked() -> None:
    plain = node_labels("baidu.com", LabelFacts(gpus=[gpu(0, cc=None)]))
    assert "nvidia.com/gpu.product" not in plain and "baidu.com/gpu.family" not in plain
    asked = node_labels("baidu.com", LabelFacts(gpus=[gpu(0)], nvidia_product=True))
    assert asked["nvidia.com/gpu.product"] == "NVIDIA-A100-PCIE-40GB"
    assert node_labels("x.io", LabelFacts()) == {}


# ------------------------------------------------------------------ on a Node


def test_the_daemon_labels_its_node_from_the_simulated_cards(
    node: Node, api: KubeApiDouble
) -> None:
    gpus = cards({**TESLA_P4, "compute_capability": "6.1"}, 2)
    node.write_gpus(gpus)
    data = yaml.safe_load(node.gpus_file.read_text())
    node.gpus_file.write_text(yaml.safe_dump({**data, "cuda_driver_version": "12.2"}))
    node.kubelet.start()
    node.settings = node.settings.__class__(
        **{
            **node.settings.__dict__,
            "node_name": NODE,
            "nvidia_product_label": True,
            "whole_cards": True,
            "card_modes": "1=exclusive",
        }
    )
    from gpushare.daemon import Daemon

    node.daemon = Daemon(node.settings)
    node.daemon.start()

    def labels() -> dict[str, str]:
        return dict(api.get("Node", NODE)["metadata"].get("labels") or {})

    assert poll(lambda: "gpushare.io/gpu.product" in labels(), 30.0)
    assert labels() == {
        "gpushare.io/gpu.product": "Tesla-P4",
        "gpushare.io/gpu.count": "2",  # the exclusive-only card counts too
        "gpushare.io/gpu.memory": "7611",
        "gpushare.io/gpu.family": "pascal",
        "gpushare.io/gpu.compute.major": "6",
        "gpushare.io/gpu.compute.minor": "1",
        "gpushare.io/cuda.driver.major": "12",
        "gpushare.io/cuda.driver.minor": "2",
        "nvidia.com/gpu.product": "Tesla-P4",
        # one card shared (the interposer), one whole-only (hardware)
        "gpushare.io/memory-enforcement": "mixed",
        "gpushare.io/memory-enforcement.interposer": "1",
        "gpushare.io/memory-enforcement.hardware": "1",
        "gpushare.io/compute-enforcement": "mixed",
        "gpushare.io/compute-enforcement.interposer": "1",
        "gpushare.io/compute-enforcement.hardware": "1",
    }
