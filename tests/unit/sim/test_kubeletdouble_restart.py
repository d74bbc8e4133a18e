"""The kubelet stand-in's restart: a registration the stopped run took never reaches the
restarted one. The real kubelet's restart ends its process, and with it a Register it was
dialling back for; the stand-in keeps one object across runs, so without a check the old
run's handler thread, still dialling, would write its endpoint into the new run's state (a
registration the restarted kubelet never took, seen as flaky healthy counts)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from kit.procs import eventually

from gpushare._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from gpushare.sim.kubeletdouble import SimulatedKubelet

RESOURCE = "gpushare.io/vcuda-memory"


class SlowPlugin(api_pb2_grpc.DevicePluginServicer):
    """A plugin whose options answer waits until released: the kubelet's dial back is
    under way for as long as the test wants."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.release = threading.Event()

    def GetDevicePluginOptions(
        self, request: api_pb2.Empty, context: grpc.ServicerContext
    ) -> api_pb2.DevicePluginOptions:
        self.asked.set()
        self.release.wait()
        return api_pb2.DevicePluginOptions()


@pytest.fixture
def kubelet(short_tmp: Path) -> Iterator[SimulatedKubelet]:
    double = SimulatedKubelet(short_tmp / "dp", short_tmp / "pr" / "kubelet.sock")
    double.start()
    yield double
    double.stop()


def test_a_register_taken_before_a_restart_does_not_reach_the_restarted_kubelet(
    kubelet: SimulatedKubelet, short_tmp: Path
) -> None:
    plugin = SlowPlugin()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    api_pb2_grpc.add_DevicePluginServicer_to_server(plugin, server)
    server.add_insecure_port(f"unix://{kubelet.plugin_dir / 'slow.sock'}")
    server.start()
    answers: list[grpc.StatusCode | None] = []

    def register() -> None:
        with grpc.insecure_channel(f"unix://{kubelet.socket}") as channel:
            stub = api_pb2_grpc.RegistrationStub(channel)
            request = api_pb2.RegisterRequest(
                version="v1beta1", endpoint="slow.sock", resource_name=RESOURCE
            )
            try:
                stub.Register(request, timeout=30)
                answers.append(None)
            except grpc.RpcError as exc:
                answers.append(exc.code())

    caller = threading.Thread(target=register)
    try:
        caller.start()
        assert plugin.asked.wait(30)  # the first run is dialling back
        kubelet.restart(remove_sockets=False)
        plugin.release.set()
        caller.join(30)
        eventually(lambda: kubelet.stale_registrations == 1)
        assert answers and answers[0] is not None  # the call did not succeed
        assert RESOURCE not in kubelet.endpoints
        assert kubelet.registrations == []
    finally:
        plugin.release.set()
        server.stop(0).wait()
