"""The host cleanup program (``python -m gpushare.node.hostsweep``, run by uninstall's
cleanup pod) over real gRPC: it reads the daemon's settings from the daemon's own
arguments, asks a PodResources server (a stand-in kubelet answering a fixed list) what
running containers hold, cleans a node laid out in a temporary directory and writes its
report; without PodResources it removes nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from gpushare._proto.podresources.v1 import api_pb2 as pr_pb2
from gpushare._proto.podresources.v1 import api_pb2_grpc as pr_pb2_grpc
from gpushare.host.library import cache_key
from gpushare.node.hostsweep import EXIT_NO_RECORDS, main

UNITS = ["GPU-0-mem-0", "GPU-0-mem-1"]


class Lister(pr_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources, as far as List goes: one pod holding ``UNITS``."""

    def List(
        self, request: pr_pb2.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr_pb2.ListPodResourcesResponse:
        devices = pr_pb2.ContainerDevices(
            resource_name="gpushare.io/vcuda-memory", device_ids=UNITS
        )
        container = pr_pb2.ContainerResources(name="main", devices=[devices])
        pod = pr_pb2.PodResources(name="p", namespace="ns", containers=[container])
        return pr_pb2.ListPodResourcesResponse(pod_resources=[pod])


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[Path]:
    socket = tmp_path / "pod-resources" / "kubelet.sock"
    socket.parent.mkdir()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    pr_pb2_grpc.add_PodResourcesListerServicer_to_server(Lister(), server)
    server.add_insecure_port(f"unix://{socket}")
    server.start()
    yield socket
    server.stop(0)


def _node(root: Path) -> list[str]:
    host = root / "vgpu"
    held = cache_key(UNITS)
    for key in (held, "c-" + "9" * 20):
        (host / "containers" / key).mkdir(parents=True)
        (host / "containers" / f"{key}.json").write_text("{}")
    (host / "mps" / "log").mkdir(parents=True)
    (root / "device-plugins").mkdir()
    (root / "device-plugins" / "gpushare-vcuda-memory.sock").write_text("")
    return [
        f"--host-lib-dir={host}",
        f"--kubelet-dir={root / 'device-plugins'}",
        f"--dra-kubelet-root={root / 'kubelet'}",
        f"--dra-cdi-dir={root / 'cdi'}",
    ]


def test_it_keeps_what_the_listed_container_holds_and_reports_it(
    tmp_path: Path, kubelet: Path
) -> None:
    daemon_args = [*_node(tmp_path), f"--pod-resources-socket={kubelet}", "--log-format=json"]
    report = tmp_path / "termination-log"
    assert main(["--held-claims=", "--report", str(report), "--", *daemon_args]) == 0
    said = json.loads(report.read_text())
    host = tmp_path / "vgpu"
    held = cache_key(UNITS)
    assert said["kept"][f"{host}/containers/{held}"] == "its container is running"
    assert said["kept"][f"{host}/mps"].startswith("MPS clients may run")
    assert said["failed"] == {} and not said["host_dir_removed"]
    assert sorted(p.name for p in (host / "containers").iterdir()) == [held, f"{held}.json"]
    assert not (tmp_path / "device-plugins" / "gpushare-vcuda-memory.sock").exists()


def test_without_the_kubelets_records_nothing_is_removed(tmp_path: Path) -> None:
    daemon_args = [*_node(tmp_path), f"--pod-resources-socket={tmp_path / 'none.sock'}"]
    report = tmp_path / "termination-log"
    assert (
        main(["--claims-unknown", "--report", str(report), "--", *daemon_args]) == EXIT_NO_RECORDS
    )
    assert "nothing removed" in json.loads(report.read_text())["error"]
    assert (tmp_path / "device-plugins" / "gpushare-vcuda-memory.sock").exists()
    assert len(list((tmp_path / "vgpu" / "containers").iterdir())) == 4


def test_settings_the_daemon_would_refuse_are_refused(tmp_path: Path) -> None:
    report = tmp_path / "termination-log"
    assert main(["--report", str(report), "--", "--host-lib-dir=relative"]) == 2
    assert "the daemon's settings" in json.loads(report.read_text())["error"]
