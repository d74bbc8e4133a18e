"""ListAndWatch streams never take what a unary call needs.

Over real unix sockets, as a kubelet (or anyone who can reach the socket) would: extra
streams are opened on the daemon's sockets, and admissions must still be answered.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from conftest import TESLA_P4, Node, cards, gpu_uuid
from kit.procs import poll

from gpushare._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from gpushare.base.kubeletgrpc import UNARY_WORKERS

#: Far more streams than unary workers (the sync server had 8 workers per socket).
EXTRA_STREAMS = 3 * UNARY_WORKERS + 10


@pytest.fixture
def streams(node: Node) -> Iterator[list[grpc.Future]]:
    node.start(cards(TESLA_P4, 2))
    channels, opened = [], []
    for resource in (node.memory, node.core):
        socket = node.kubelet.endpoints[resource].socket
        channel = grpc.insecure_channel(f"unix://{socket}")
        channels.append(channel)
        stub = api_pb2_grpc.DevicePluginStub(channel)
        opened.extend(stub.ListAndWatch(api_pb2.Empty()) for _ in range(EXTRA_STREAMS))
    assert node.daemon is not None
    servicers = [server.servicer for server in node.daemon.plugin.servers]
    # Held by the server: the kubelet's own stream and every extra one, on both sockets.
    held = poll(lambda: all(s.active_streams == EXTRA_STREAMS + 1 for s in servicers), 20.0)
    try:
        assert held, [s.active_streams for s in servicers]
        yield opened
    finally:
        for stream in opened:
            stream.cancel()
        for channel in channels:
            channel.close()


def test_extra_list_and_watch_streams_leave_admissions_answered(
    node: Node, streams: list[grpc.Future]
) -> None:
    assert len(streams) == 2 * EXTRA_STREAMS
    for i in range(3):
        admitted = node.kubelet.admit(f"p{i}", "main", {node.memory: 4, node.core: 10})
        assert admitted.card() in {gpu_uuid(0), gpu_uuid(1)}
    options = node.kubelet.endpoints[node.memory].stub.GetDevicePluginOptions(
        api_pb2.Empty(), timeout=5
    )
    assert options.get_preferred_allocation_available


def test_every_open_stream_gets_a_health_change(node: Node, streams: list[grpc.Future]) -> None:
    assert node.daemon is not None and node.daemon.core.health is not None
    for stream in streams:  # each stream's first list is sent before the change is made
        first = next(stream)  # the list as it was when the stream opened
        assert len(first.devices) in (2 * 29, 2 * 100)
        assert {d.health for d in first.devices} == {"Healthy"}
    node.daemon.core.health.set(gpu_uuid(1), False, "test")
    for stream in streams:
        update = next(stream)
        unhealthy = {d.ID.split("::")[0] for d in update.devices if d.health == "Unhealthy"}
        assert unhealthy == {gpu_uuid(1)}
    admitted = node.kubelet.admit("after", "main", {node.memory: 4})
    assert admitted.card() == gpu_uuid(0)


def test_streams_end_when_the_daemon_stops(node: Node, streams: list[grpc.Future]) -> None:
    node.stop()
    for stream in streams:
        try:
            left = list(stream)  # ends: no stream outlives the daemon
        except grpc.RpcError as exc:
            assert exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        else:
            assert len(left) <= 1 and stream.code() == grpc.StatusCode.OK  # the first list
