"""gpushare.node.discovery: the simulated node file is read when given; cards in MIG
mode that cardModes gives to DRA are taken out of the device plugin's plan; a start
that cannot read the GPUs waits (saying why) and gives up at once when stopped; with
failOnInitError it fails at once."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import yaml
from kit.procs import eventually

from gpushare.base.startup import StartupError
from gpushare.config import Settings
from gpushare.gpu.gpus import Gpu, GpuError
from gpushare.gpu.simulated import SimulatedBackend
from gpushare.node.discovery import Discovery, dra_mig_cards, open_backend, plan_gpus


def gpu(index: int, mig: bool = False, pending: bool = False) -> Gpu:
    return Gpu(f"GPU-{index}", "NVIDIA A100", 40960, index, index, mig_enabled=mig,
               mig_pending=pending)  # fmt: skip


def test_a_node_file_means_the_simulated_backend(tmp_path: Path) -> None:
    node_file = tmp_path / "node.yaml"
    node_file.write_text(
        yaml.safe_dump({"gpus": [{"uuid": "GPU-a", "name": "T4", "memory_mib": 15360}]})
    )
    backend = open_backend(str(node_file))
    assert isinstance(backend, SimulatedBackend)
    assert [g.uuid for g in backend.discover()] == ["GPU-a"]


def test_only_settled_mig_cards_named_dra_go_to_the_dra_driver() -> None:
    gpus = [gpu(0, mig=True), gpu(1, mig=True, pending=True), gpu(2), gpu(3, mig=True)]
    assert [g.index for g in dra_mig_cards(gpus, "0=dra,1=dra,2=dra")] == [0]
    assert [g.index for g in dra_mig_cards(gpus, "GPU-3=dra")] == [3]
    assert dra_mig_cards(gpus, "0:dra") == []
    assert dra_mig_cards(gpus, "") == []


def test_without_mig_every_card_is_shared() -> None:
    plan = plan_gpus([gpu(0), gpu(1)], "none")
    assert [g.uuid for g in plan.shared_gpus()] == ["GPU-0", "GPU-1"]


class Unreadable:
    """A backend whose driver does not answer (yet)."""

    def __init__(self) -> None:
        self.tries = 0

    def discover(self) -> list[Gpu]:
        self.tries += 1
        raise GpuError("NVML: driver not loaded")

    def close(self) -> None:
        pass


def test_unreadable_gpus_are_waited_for_and_a_stop_ends_the_wait() -> None:
    stopping = threading.Event()
    backend = Unreadable()
    discovery = Discovery(Settings(), stopping, backend)  # type: ignore[arg-type]
    failed: list[BaseException] = []

    def start() -> None:
        try:
            discovery.run()
        except StartupError as exc:
            failed.append(exc)

    thread = threading.Thread(target=start)
    thread.start()
    eventually(lambda: discovery.waiting_for)
    assert (
        "attempt 1 failed" in discovery.waiting_for and "driver not loaded" in discovery.waiting_for
    )
    stopping.set()
    thread.join(timeout=30)
    assert not thread.is_alive() and "stopped while waiting" in str(failed[0])


def test_fail_on_init_error_fails_at_once() -> None:
    backend = Unreadable()
    discovery = Discovery(Settings(fail_on_init_error=True), threading.Event(), backend)  # type: ignore[arg-type]
    with pytest.raises(StartupError, match="driver not loaded"):
        discovery.run()
    assert backend.tries == 1
