"""Quantities as the API server writes them back: ``1000`` units read as ``"1k"``.

The API server re-emits every quantity in canonical form, and extended resources may
be written with any suffix that makes a whole number (``3``, ``3000m``, ``3Ki``). The
kubelet reads the number and asks the daemon for that many units; the daemon's pod
specs used to read only plain digits, so a container asking 1000 memory units looked
like one asking none: its pod was dropped by the watch, and its core Allocate refused
as "asks no memory".
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import TESLA_P4, Node, cards
from hypothesis import given
from hypothesis import strategies as st

from gpushare.base.quantity import MAX_QUANTITY, whole_units
from gpushare.kube.podslim import slim
from gpushare.kube.podspecs import PodSpecBook
from gpushare.share.devices import Resource
from gpushare.share.usage import Holder

DECIMAL = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}
BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def spellings(n: int) -> list[str]:
    """Ways the API server may write ``n`` (canonical or as the author wrote it)."""
    found = [str(n), f"{n * 1000}m", f"{n}e0", f"+{n}"]
    found += [f"{n // f}{s}" for s, f in {**DECIMAL, **BINARY}.items() if n and n % f == 0]
    found += [f"{n // 10**e}e{e}" for e in (1, 3, 6) if n and n % 10**e == 0]
    return found


@given(st.integers(min_value=0, max_value=10**15), st.data())
def test_every_spelling_of_a_whole_number_reads_as_that_number(n: int, data: Any) -> None:
    text = data.draw(st.sampled_from(spellings(n)))
    assert whole_units(text) == n


@pytest.mark.parametrize(
    "text",
    ["", "k", "-1", "1.5", "1500m", "0.5", "1.0005k", "1Ki5", "1 k", "\u0661", "\u00b2",
     "1kk", "1e-1", "9" * 65, "1e999", str(MAX_QUANTITY + 1), "1Ei0", "NaN", "1\n"],
)  # fmt: skip
def test_what_is_not_a_whole_quantity_reads_as_none(text: str) -> None:
    assert whole_units(text) is None


def test_types() -> None:
    assert whole_units(7) == 7
    assert whole_units(True) is None
    assert whole_units(-1) is None
    assert whole_units(None) is None
    assert whole_units([1]) is None


def pod_asking(memory: str, core: str) -> dict[str, Any]:
    limits = {"gpushare.io/vcuda-memory": memory, "gpushare.io/vcuda-core": core}
    return {
        "metadata": {"name": "canon", "namespace": "default", "uid": "uid-canon"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
        "status": {"phase": "Pending"},
    }


def test_the_watch_keeps_and_the_book_reads_a_canonical_quantity() -> None:
    pod = pod_asking("1k", "0")
    kept = slim(pod, "gpushare.io")
    assert kept is not None, "a pod asking 1k memory units was dropped as asking no GPU"
    book = PodSpecBook("gpushare.io")
    book.update(kept)
    wanted = book.requests_of(Holder("default", "canon", "main"))
    assert wanted == {Resource.MEMORY: 1000, Resource.CORE: 0}


def test_a_container_asking_1k_memory_units_and_cores_is_served(node: Node) -> None:
    """Real gRPC: the core Allocate is not refused as "asks no memory units"."""
    node.with_pod_specs()
    node.start(cards(TESLA_P4, 1), memory_unit_mib=4)  # 1902 units on the card
    assert node.specs is not None
    spec = {node.memory: 1000, node.core: 50}
    pod = node.pod("canon", spec)
    pod["spec"]["containers"][0]["resources"]["limits"][node.memory] = "1k"  # as served
    node.specs.update(pod)
    record = node.kubelet.admit("canon", "main", spec, order=[node.core, node.memory])
    assert record.envs["CUDA_DEVICE_SM_LIMIT"] == "50"
    assert record.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4000m"
