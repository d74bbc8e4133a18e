"""The start-up decision on a simulated node: the driver's version and each card's
memory-limit calls come from the simulated NVML (gpu/memlimits.py, the store the hook's
stand-in NVML shares), the cgroup type from the cgroup root. ``driver`` is given only to a
card whose self-test (set, read back, clear on a scratch cgroup) passed; a pin the node
cannot give stops the start with the reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
import yaml

from gpushare.base.startup import NodeConfigurationError
from gpushare.config import Settings
from gpushare.gpu.gpus import GpuError
from gpushare.gpu.memlimits import UNLIMITED, MemoryLimits
from gpushare.gpu.simulated import SimulatedBackend
from gpushare.node.backendfacts import card_traits, cgroup_type, decide_backends, self_test
from gpushare.share.backendchoice import ComputeBackend, MemoryBackend
from gpushare.share.cardmodes import CardMode

A, B = "GPU-aaaa", "GPU-bbbb"


def node_file(tmp_path: Path, version: str | None = "615.20.01", **modes: str) -> Path:
    gpus = [
        {"uuid": A, "memory_mib": 16384, "memory_limits": modes.get("a", "ok")},
        {"uuid": B, "memory_mib": 16384, "memory_limits": modes.get("b", "ok")},
    ]
    data: dict[str, object] = {"gpus": gpus}
    if version is not None:
        data["driver_version"] = version
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def cgroup_v2(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup"
    root.mkdir(exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    return root


def decide(tmp_path: Path, backend: SimulatedBackend, root: Path, **options: str) -> dict:  # type: ignore[type-arg]
    settings = Settings(simulate=str(backend.path), cgroup_root=str(root), **options)  # type: ignore[arg-type]
    gpus = backend.discover()
    modes = {g.uuid: CardMode.BOTH for g in gpus}
    traits = card_traits(gpus, [], modes, uses_cdi="cdi" in settings.device_list_strategy)
    return decide_backends(settings, backend, traits)


def test_the_simulated_driver_keeps_limits_per_cgroup(tmp_path: Path) -> None:
    backend = SimulatedBackend(node_file(tmp_path))
    assert backend.driver_version() == "615.20.01"
    one, two = tmp_path / "c1", tmp_path / "c2"
    one.mkdir(), two.mkdir()
    assert backend.get_memory_limits(A, str(one)) is None  # no limit: NOT_SUPPORTED
    backend.set_memory_limits(A, str(one), 0, 1 << 30)
    backend.set_memory_limits(B, str(one), 0, 2 << 30)
    assert backend.get_memory_limits(A, str(one)) == MemoryLimits(0, 1 << 30)
    assert backend.get_memory_limits(B, str(one)) == MemoryLimits(0, 2 << 30)
    assert backend.get_memory_limits(A, str(two)) is None
    backend.set_memory_limits(A, str(one), 0, UNLIMITED)
    assert backend.get_memory_limits(A, str(one)) is None
    with pytest.raises(Exception, match="gone or not visible"):
        backend.set_memory_limits(A, str(tmp_path / "gone"), 0, 1)


def test_a_bad_memory_limits_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(GpuError, match="memory_limits"):
        SimulatedBackend(node_file(tmp_path, a="sometimes"))


def test_cgroup_type(tmp_path: Path) -> None:
    assert cgroup_type(tmp_path) == "none"
    (tmp_path / "memory").mkdir()
    assert cgroup_type(tmp_path) == "v1"
    (tmp_path / "cgroup.controllers").write_text("")
    assert cgroup_type(tmp_path) == "v2"


@pytest.mark.parametrize("mode, says", [("ok", ""), ("broken", "not enforced"),
                                        ("unsupported", "Not Supported")])  # fmt: skip
def test_self_test_sets_reads_back_and_clears(tmp_path: Path, mode: str, says: str) -> None:
    backend = SimulatedBackend(node_file(tmp_path, a=mode))
    root = cgroup_v2(tmp_path)
    result = self_test(backend, A, root)
    assert (result == "") == (says == "") and says in result
    assert backend.limit_store.limits() == {}  # cleared
    assert sorted(p.name for p in root.iterdir()) == ["cgroup.controllers"]  # scratch gone


def test_auto_takes_driver_where_it_holds(tmp_path: Path) -> None:
    backend = SimulatedBackend(node_file(tmp_path, b="broken"))
    choices = decide(tmp_path, backend, cgroup_v2(tmp_path), device_list_strategy="cdi-cri")
    assert choices[A].memory is MemoryBackend.DRIVER
    assert choices[B].memory is MemoryBackend.INTERPOSER  # failed its self-test: reported
    assert "self-test failed" in choices[B].memory_reason
    assert {c.compute for c in choices.values()} == {ComputeBackend.INTERPOSER}


def test_one_event_per_card_with_the_reasons(tmp_path: Path) -> None:
    backend = SimulatedBackend(node_file(tmp_path))
    with structlog.testing.capture_logs() as logs:
        decide(tmp_path, backend, cgroup_v2(tmp_path))
    events = [e for e in logs if e["event"] == "enforcement_backend"]
    assert sorted(e["card"] for e in events) == [A, B]
    assert all(e["memory"] == "interposer" and "no CDI" in e["memory_reason"] for e in events)


@pytest.mark.parametrize(
    "version, cgroup, options, says",
    [
        ("550.54.15", "v2", {"device_list_strategy": "cdi-cri"}, "driver version 550.54.15"),
        (None, "v2", {"device_list_strategy": "cdi-cri"}, "driver version unknown"),
        ("615.20.01", "v1", {"device_list_strategy": "cdi-cri"}, "cgroup v1"),
        ("615.20.01", "v2", {}, "no CDI"),
    ],
)
def test_a_pinned_driver_the_node_cannot_give_stops_the_start(
    tmp_path: Path, version: str | None, cgroup: str, options: dict[str, str], says: str
) -> None:
    backend = SimulatedBackend(node_file(tmp_path, version))
    root = cgroup_v2(tmp_path) if cgroup == "v2" else tmp_path / "v1"
    if cgroup == "v1":
        (root / "memory").mkdir(parents=True)
    with pytest.raises(NodeConfigurationError, match=says) as caught:
        decide(tmp_path, backend, root, memory_enforcement="1=driver", **options)
    assert "card 1 (GPU-bbbb)" in str(caught.value) and "\n" not in str(caught.value)
    # auto on the same node: the interposer, and why not driver
    choices = decide(tmp_path, backend, root, **options)
    assert choices[B].memory is MemoryBackend.INTERPOSER and says in choices[B].memory_reason


def test_a_pinned_driver_on_a_card_that_fails_its_self_test_stops_the_start(
    tmp_path: Path,
) -> None:
    backend = SimulatedBackend(node_file(tmp_path, a="unsupported"))
    with pytest.raises(NodeConfigurationError, match=r"self-test failed: .*Not Supported"):
        decide(tmp_path, backend, cgroup_v2(tmp_path), memory_enforcement="driver",
               device_list_strategy="cdi-cri")  # fmt: skip


def test_pins_naming_no_card_and_mps_are_refused(tmp_path: Path) -> None:
    backend = SimulatedBackend(node_file(tmp_path))
    with pytest.raises(NodeConfigurationError, match="names no GPU of this node: 5"):
        decide(tmp_path, backend, cgroup_v2(tmp_path), memory_enforcement="5=interposer")
    with pytest.raises(NodeConfigurationError, match="to mps, which this node cannot give"):
        decide(tmp_path, backend, cgroup_v2(tmp_path), compute_enforcement="mps")


def test_no_enforcement_is_none(tmp_path: Path) -> None:
    backend = SimulatedBackend(node_file(tmp_path))
    choices = decide(tmp_path, backend, cgroup_v2(tmp_path), no_enforcement=True)  # type: ignore[arg-type]
    assert {c.memory for c in choices.values()} == {MemoryBackend.NONE}
    assert {c.compute for c in choices.values()} == {ComputeBackend.NONE}
