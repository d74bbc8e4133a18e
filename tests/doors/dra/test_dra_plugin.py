"""The DRA kubelet plugin over real unix sockets, claims served by the API-server double.

The stand-in kubelet (:mod:`gpushare.sim.drakubeletdouble`) registers through the plugin
watcher's socket and calls NodePrepareResources / NodeUnprepareResources with only the
claim's namespace, name and UID, as the real kubelet does.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest
from kit.memhook import shared_hook

from gpushare._proto.drahealth.v1alpha1 import api_pb2 as health_pb2
from gpushare._proto.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from gpushare.base.kubeletgrpc import UNARY_WORKERS
from gpushare.config import Settings
from gpushare.dra.part import DraPart, build_dra_part
from gpushare.gpu.gpus import Gpu
from gpushare.gpu.health import HealthBoard
from gpushare.host.elf import stand_in
from gpushare.host.library import cache_root, ensure_lock_dir, install_hook, install_library
from gpushare.kube.stdlibclient import ApiClient, kubeconfig_endpoint
from gpushare.share.answers import CDI_CRI, DeviceListing, Enforcement
from gpushare.sim.apidouble import KubeApiDouble
from gpushare.sim.drakubeletdouble import DraKubelet, RegistrationRefused, allocated_claim

DRIVER = "gpu.gpushare.io"
#: conftest.NODE, the Node the ``api`` fixture holds (not imported: tests/e2e has its own
#: conftest module, and the real-server tests there use DraNode too).
NODE = "gpu-node-1"
GIB = 1 << 30


def gpu(index: int, memory_mib: int = 24576) -> Gpu:
    return Gpu(
        uuid=f"GPU-{index:08d}",
        name="NVIDIA A100",
        memory_mib=memory_mib,
        index=index,
        minor=index,
        compute_capability=(8, 0),
    )


class DraNode:
    """A node with the DRA part running against the double, and a stand-in kubelet."""

    def __init__(self, root: Path, api: KubeApiDouble, **settings: Any) -> None:
        self.root = root
        self.api = api
        self.gpus = [gpu(0), gpu(1)]
        self.board = HealthBoard(g.uuid for g in self.gpus)
        host = root / "vgpu"
        library = root / "libvgpu.so"
        library.write_bytes(stand_in(b"interposer\n"))
        self.enforcement = Enforcement(
            library=install_library(library, host),
            preload_file=None,
            use_ld_preload_env=True,
            lock_dir=ensure_lock_dir(host),
            limit_check=str(install_hook(shared_hook(), host)),
        )
        self.host = host
        self.cdi = root / "cdi"
        self.settings = Settings(
            **{
                "host_lib_dir": str(host),
                "dra_cdi_dir": str(self.cdi),
                "dra_resync_seconds": 0.05,
                **settings,
            }
        )
        self.kubelet_root = root / "kubelet"
        self.client = ApiClient(kubeconfig_endpoint(api.kubeconfig(root / "kubeconfig")))
        self.listing = DeviceListing()
        self.part: DraPart | None = None
        self.kubelet = DraKubelet(self.kubelet_root)
        #: the node's pods by UID as a pod watch holds them (the daemon's PodWatch)
        self.watched_pod: Any = None

    def build(self) -> DraPart:
        return build_dra_part(
            self.settings,
            self.gpus,
            self.board,
            self.enforcement,
            self.listing,
            self.host,
            self.client,
            NODE,
            self.kubelet_root,
            pcie_roots={},
            watched_pod=self.watched_pod,
        )

    def start(self) -> DraPart:
        self.part = self.build()
        self.part.start()
        self.kubelet.register()
        return self.part

    def stop(self) -> None:
        self.kubelet.close()
        if self.part is not None:
            self.part.stop()
            self.part = None

    def claim(self, name: str, *results: dict[str, Any]) -> tuple[str, str, str]:
        obj = self.api.add(allocated_claim("default", name, DRIVER, NODE, results))
        return ("default", name, obj["metadata"]["uid"])

    def spec(self, uid: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.cdi / f"{DRIVER}-claim_{uid}.json").read_text())
        return data


def wait_until(check: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.01)
    return bool(check())


@pytest.fixture
def dra(short_tmp: Path, api: KubeApiDouble) -> Iterator[DraNode]:
    node = DraNode(short_tmp, api)
    try:
        yield node
    finally:
        node.stop()


def env_of(spec: dict[str, Any], device: int = 0) -> dict[str, str]:
    entries = spec["devices"][device]["containerEdits"]["env"]
    return dict(e.split("=", 1) for e in entries)


def test_registers_with_v1_first(dra: DraNode) -> None:
    dra.start()
    assert dra.kubelet.version == "v1.DRAPlugin"
    info = dra.kubelet.info
    assert info.type == "DRAPlugin" and info.name == DRIVER
    assert list(info.supported_versions) == [
        "v1.DRAPlugin",
        "v1beta1.DRAPlugin",
        "v1alpha1.DRAResourceHealth",
    ]
    assert info.endpoint == str(dra.kubelet_root / "plugins" / DRIVER / "dra.sock")
    # an older kubelet that knows only v1beta1 gets it
    old = DraKubelet(dra.kubelet_root)
    assert old.register(versions=["v1beta1.DRAPlugin"]) == "v1beta1.DRAPlugin"
    old.close()
    with pytest.raises(RegistrationRefused):
        DraKubelet(dra.kubelet_root).register(versions=["v2.DRAPlugin"])
    assert dra.part is not None and dra.part.server.registered is False


@pytest.mark.parametrize("version", ["v1.DRAPlugin", "v1beta1.DRAPlugin"])
def test_prepare_answers_cdi_with_the_rounded_limits(dra: DraNode, version: str) -> None:
    dra.start()
    dra.kubelet.register(versions=[version])
    ref = dra.claim(
        "share",
        {"request": "gpu", "device": "gpu-1", "consumedCapacity": {"memory": "4Gi", "cores": "30"}},
    )
    (answer,) = dra.kubelet.prepare([ref]).values()
    assert answer.error == ""
    ((requests, pool, device, cdi),) = answer.devices
    assert (requests, pool, device) == (["gpu"], NODE, "gpu-1")
    uid = ref[2]
    assert cdi == [f"{DRIVER}/claim={uid}-gpu-gpu-1"]
    spec = dra.spec(uid)
    assert spec["kind"] == f"{DRIVER}/claim"
    env = env_of(spec)
    # the device plugin's answer: same keys, rounded limits, the card's UUID
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "4096m"
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30"
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-00000001"
    assert env["LD_PRELOAD"] == "/usr/local/vgpu/libvgpu.so"
    mounts = {m["containerPath"]: m for m in spec["devices"][0]["containerEdits"]["mounts"]}
    assert mounts["/usr/local/vgpu/libvgpu.so"]["options"][0] == "ro"
    cache = Path(mounts["/usr/local/vgpu/cache"]["hostPath"])
    assert cache.parent == cache_root(dra.host) and cache.is_dir()
    assert oct(cache.stat().st_mode & 0o777) == "0o777"
    assert oct(cache_root(dra.host).stat().st_mode & 0o777) == "0o700"


def test_unaligned_capacity_is_enforced_as_charged(dra: DraNode) -> None:
    dra.start()
    ref = dra.claim(
        "odd", {"request": "r", "device": "gpu-0", "consumedCapacity": {"memory": "1000Mi"}}
    )
    (answer,) = dra.kubelet.prepare([ref]).values()
    assert answer.error == ""
    env = env_of(dra.spec(ref[2]))
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1000m"  # its charge, never more
    assert "CUDA_DEVICE_SM_LIMIT" not in env  # no cores: unthrottled


def test_no_consumed_capacity_is_the_whole_card(dra: DraNode) -> None:
    dra.start()
    ref = dra.claim("whole", {"request": "r", "device": "gpu-0"})
    dra.kubelet.prepare([ref])
    env = env_of(dra.spec(ref[2]))
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "24576m"


def test_refusals_are_per_claim_and_readable(dra: DraNode) -> None:
    dra.start()
    good = dra.claim("good", {"request": "r", "device": "gpu-0"})
    unallocated = dra.api.add(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": "pending", "namespace": "default", "uid": "u-pending"},
        }
    )
    stranger = dra.claim("stranger", {"request": "r", "device": "gpu-7"})
    too_big = dra.claim(
        "big", {"request": "r", "device": "gpu-0", "consumedCapacity": {"memory": "80Gi"}}
    )
    answers = dra.kubelet.prepare(
        [
            good,
            ("default", "pending", unallocated["metadata"]["uid"]),
            ("default", "good", "another-uid"),  # re-created under the same name
            ("default", "missing", "u-missing"),
            ("default", "../../nodes/x", "u-x"),
            stranger,
            too_big,
        ]
    )
    assert answers[good[2]].error == ""
    assert "is not allocated" in answers["u-pending"].error
    assert "has UID" in answers["another-uid"].error
    assert "not found" in answers["u-missing"].error
    assert "is not a ResourceClaim name" in answers["u-x"].error
    assert (
        "gpu-7" in answers[stranger[2]].error
        and "not one of this node's" in answers[stranger[2]].error
    )
    assert "80Gi" in answers[too_big[2]].error
    for text in (a.error for a in answers.values()):
        assert "\n" not in text
    assert sorted(p.name for p in dra.cdi.iterdir()) == [f"{DRIVER}-claim_{good[2]}.json"]


def test_prepare_and_unprepare_are_idempotent(dra: DraNode) -> None:
    dra.start()
    ref = dra.claim("c", {"request": "r", "device": "gpu-0", "consumedCapacity": {"memory": "2Gi"}})
    first = dra.kubelet.prepare([ref])
    gets = len(dra.api.calls("GET", "/resourceclaims/"))
    assert dra.kubelet.prepare([ref]) == first
    assert len(dra.api.calls("GET", "/resourceclaims/")) == gets  # from the checkpoint
    keys = [p for p in cache_root(dra.host).iterdir() if p.name.startswith("d-")]
    assert len(keys) == 1  # the directory (the checkpoint names its claim)
    assert dra.kubelet.unprepare([ref]) == {ref[2]: ""}
    assert list(dra.cdi.iterdir()) == []
    assert [p for p in cache_root(dra.host).iterdir() if p.name.startswith("d-")] == []
    assert dra.kubelet.unprepare([ref]) == {ref[2]: ""}
    assert dra.kubelet.unprepare([("default", "never", "u-never")]) == {"u-never": ""}


def test_checkpoint_survives_a_restart_between_prepare_and_unprepare(dra: DraNode) -> None:
    dra.start()
    ref = dra.claim("c", {"request": "r", "device": "gpu-1", "consumedCapacity": {"memory": "1Gi"}})
    first = dra.kubelet.prepare([ref])
    dra.stop()
    dra.api.delete("ResourceClaim", "c", "default", "resource.k8s.io/v1")  # gone meanwhile
    dra.start()
    assert dra.kubelet.prepare([ref]) == first  # answered from the checkpoint
    assert dra.kubelet.unprepare([ref]) == {ref[2]: ""}
    assert list(dra.cdi.iterdir()) == []


def test_leftovers_without_a_checkpoint_entry_are_sorted_out_at_start(dra: DraNode) -> None:
    """Killed before recording: the spec (a container may run with it) is kept and the
    claim's entry recovered from it until the kubelet unprepares it; killed before the
    spec, the cache directory was never handed out and goes."""
    dra.start()
    ref = dra.claim("c", {"request": "r", "device": "gpu-1"})
    other = dra.claim("o", {"request": "r", "device": "gpu-0"})
    dra.kubelet.prepare([ref, other])
    dra.stop()
    (dra.host / "dra" / "claims" / f"{ref[2]}.json").unlink()  # as if killed before recording
    (dra.host / "dra" / "claims" / f"{other[2]}.json").unlink()
    (dra.cdi / f"{DRIVER}-claim_{other[2]}.json").unlink()  # ...or before the spec
    dra.start()
    assert [p.name for p in dra.cdi.iterdir()] == [f"{DRIVER}-claim_{ref[2]}.json"]
    assert len([p for p in cache_root(dra.host).iterdir() if p.name.startswith("d-")]) == 1
    assert dra.kubelet.unprepare([ref]) == {ref[2]: ""}
    assert list(dra.cdi.iterdir()) == []
    assert [p for p in cache_root(dra.host).iterdir() if p.name.startswith("d-")] == []


def test_cdi_listing_adds_the_card_name(short_tmp: Path, api: KubeApiDouble) -> None:
    node = DraNode(short_tmp, api)
    node.listing = DeviceListing(strategies=frozenset({CDI_CRI}))
    try:
        node.start()
        ref = node.claim("c", {"request": "r", "device": "gpu-1"})
        (answer,) = node.kubelet.prepare([ref]).values()
        assert answer.devices[0][3][1] == "nvidia.com/gpu=GPU-00000001"
        assert env_of(node.spec(ref[2]))["NVIDIA_VISIBLE_DEVICES"] == "void"
    finally:
        node.stop()


def test_unhealthy_card_is_refused_and_reported(dra: DraNode) -> None:
    dra.start()
    stream = dra.kubelet.watch_health()
    assert next(stream) == {"gpu-0": "HEALTHY", "gpu-1": "HEALTHY"}
    dra.board.set("GPU-00000001", False, "XID 79")
    assert next(stream) == {"gpu-0": "HEALTHY", "gpu-1": "UNHEALTHY"}
    ref = dra.claim("c", {"request": "r", "device": "gpu-1"})
    (answer,) = dra.kubelet.prepare([ref]).values()
    assert "unhealthy (XID 79)" in answer.error
    dra.board.set("GPU-00000001", True)
    assert next(stream) == {"gpu-0": "HEALTHY", "gpu-1": "HEALTHY"}


def _hold_lock(state_dir: str, held: Any, release: Any) -> None:
    from gpushare.dra.checkpoint import NodeLock

    with NodeLock(Path(state_dir) / "prepare.lock").held():
        held.set()
        release.wait(30)


def test_a_second_daemon_holding_the_lock_serialises_prepare(dra: DraNode) -> None:
    dra.start()
    ref = dra.claim("c", {"request": "r", "device": "gpu-0"})
    ctx = multiprocessing.get_context("fork")
    held, release = ctx.Event(), ctx.Event()
    other = ctx.Process(target=_hold_lock, args=(str(dra.host / "dra"), held, release))
    other.start()
    try:
        assert held.wait(60)
        answers: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: answers.update(dra.kubelet.prepare([ref])))
        worker.start()
        worker.join(0.3)
        assert worker.is_alive() and not answers  # waits for the other daemon
        release.set()
        worker.join(60)
        assert answers[ref[2]].error == ""
    finally:
        release.set()
        other.join(10)


def test_an_unreadable_entry_is_recovered_for_its_claim_alone(dra: DraNode) -> None:
    dra.start()
    one = dra.claim("one", {"request": "r", "device": "gpu-0"})
    two = dra.claim("two", {"request": "r", "device": "gpu-1"})
    dra.kubelet.prepare([one, two])
    entry = dra.host / "dra" / "claims" / f"{one[2]}.json"
    entry.write_text("{not json")
    errors = dra.kubelet.unprepare([one, two])
    assert errors == {one[2]: "", two[2]: ""}
    # recovered from the claim's CDI spec: what it named is gone, the bad file set aside
    assert list(dra.cdi.iterdir()) == []
    assert [p for p in cache_root(dra.host).iterdir() if p.name.startswith("d-")] == []
    assert entry.with_name(f"{entry.name}.unusable").read_text() == "{not json"


def test_an_old_instance_stopping_leaves_the_new_ones_sockets(dra: DraNode) -> None:
    """A rolling update: the new daemon takes the socket paths over while the old one
    still runs; the old one stopping must not remove what the new one serves on."""
    old = dra.start()
    new = dra.build()
    new.start()
    try:
        old.stop()
        dra.part = None
        kubelet = DraKubelet(dra.kubelet_root)
        assert kubelet.register() == "v1.DRAPlugin"
        ref = dra.claim("c", {"request": "r", "device": "gpu-0"})
        assert kubelet.prepare([ref])[ref[2]].error == ""
        kubelet.close()
    finally:
        new.stop()


def test_sockets_are_private(dra: DraNode) -> None:
    dra.start()
    for path in (
        dra.kubelet_root / "plugins_registry" / f"{DRIVER}-reg.sock",
        dra.kubelet_root / "plugins" / DRIVER / "dra.sock",
    ):
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"


def test_settings_default_driver() -> None:
    assert Settings().dra_driver == DRIVER
    assert replace(Settings(), dra_driver="x.example").dra_driver == "x.example"


def test_what_each_prepared_device_holds_is_recorded_and_kept_in_memory(dra: DraNode) -> None:
    part = dra.start()
    small = dra.claim(
        "small",
        {
            "request": "r",
            "device": "gpu-1",
            "consumedCapacity": {"memory": "1000Mi", "cores": "30"},
        },
    )
    whole = dra.claim("whole", {"request": "r", "device": "gpu-0"})
    dra.kubelet.prepare([small, whole])
    entry = json.loads((dra.host / "dra" / "claims" / f"{small[2]}.json").read_text())
    (device,) = entry["claim"]["devices"]
    assert (device["card"], device["mig"], device["memory_mib"], device["cores"]) == (
        "GPU-00000001",
        "",
        1000,  # the limit enforced: the charge
        30,
    )
    shares = part.shares()
    assert {
        uuid: [(c.claim, c.memory_mib, c.cores) for c in found] for uuid, found in shares.items()
    } == {
        "GPU-00000000": [("whole", 24576, 0)],
        "GPU-00000001": [("small", 1000, 30)],
    }
    dra.kubelet.unprepare([whole])
    assert set(part.shares()) == {"GPU-00000001"}


def test_an_entry_written_before_sizes_were_recorded_still_reads(dra: DraNode) -> None:
    """A checkpoint entry of an earlier daemon: no card, MIG, memory or cores."""
    dra.start()
    ref = dra.claim("c", {"request": "r", "device": "gpu-1", "consumedCapacity": {"memory": "1Gi"}})
    first = dra.kubelet.prepare([ref])
    dra.stop()
    path = dra.host / "dra" / "claims" / f"{ref[2]}.json"
    entry = json.loads(path.read_text())
    for device in entry["claim"]["devices"]:
        for key in ("card", "mig", "memory_mib", "cores"):
            del device[key]
    path.write_text(json.dumps(entry))
    part = dra.start()
    (claim,) = part.shares()["GPU-00000001"]  # the card, from the device's name
    assert (claim.claim, claim.device, claim.memory_mib, claim.cores) == ("c", "gpu-1", None, None)
    assert dra.kubelet.prepare([ref]) == first  # answered from the old entry
    assert dra.kubelet.unprepare([ref]) == {ref[2]: ""}
    assert part.shares() == {}
    assert list(dra.cdi.iterdir()) == []


def test_a_mig_device_records_itself_and_its_parent_card(dra: DraNode) -> None:
    from gpushare.gpu.gpus import MigDevice

    parent = dra.gpus[1]
    mig = MigDevice("MIG-aaaa", parent.uuid, "3g.20gb", 19968, gpu_instance=1, compute_instance=0)
    dra.gpus[1] = replace(parent, mig_enabled=True, mig_devices=(mig,))
    dra.board = HealthBoard([*(g.uuid for g in dra.gpus), mig.uuid])
    part = dra.start()
    ref = dra.claim("m", {"request": "r", "device": "gpu-1-mig-1-0"})
    assert dra.kubelet.prepare([ref])[ref[2]].error == ""
    entry = json.loads((dra.host / "dra" / "claims" / f"{ref[2]}.json").read_text())
    (device,) = entry["claim"]["devices"]
    assert (device["card"], device["mig"], device["memory_mib"], device["cores"]) == (
        parent.uuid,
        "MIG-aaaa",
        19968,
        0,
    )
    (claim,) = part.shares()[parent.uuid]
    assert (claim.device, claim.memory_mib) == ("gpu-1-mig-1-0", 19968)


def test_a_mig_device_missing_from_the_health_board_is_a_build_error(dra: DraNode) -> None:
    from gpushare.gpu.gpus import MigDevice

    parent = dra.gpus[1]
    mig = MigDevice("MIG-bbbb", parent.uuid, "1g.5gb", 4864, gpu_instance=9, compute_instance=0)
    dra.gpus[1] = replace(parent, mig_enabled=True, mig_devices=(mig,))
    with pytest.raises(ValueError, match="MIG-bbbb"):
        dra.build()  # its health would read "unhealthy" forever


def test_health_streams_hold_no_worker_and_prepare_is_still_answered(dra: DraNode) -> None:
    """Far more health streams than the kit's unary workers (the thread-pool server this
    replaced ran each stream on one of 8 workers): all of them are served, a claim is
    still prepared, and a health change reaches every stream."""
    dra.start()
    channel = grpc.insecure_channel(f"unix://{dra.kubelet_root / 'plugins' / DRIVER / 'dra.sock'}")
    stub = health_grpc.DRAResourceHealthStub(channel)
    streams = [
        # a deadline: a stream that is never served fails the test instead of hanging it
        stub.NodeWatchResources(health_pb2.NodeWatchResourcesRequest(), timeout=120)
        for _ in range(3 * UNARY_WORKERS + 10)
    ]
    try:
        for stream in streams:  # every stream is open and has its first list
            assert len(next(stream).devices) == 2
        ref = dra.claim("busy", {"request": "r", "device": "gpu-0"})
        (answer,) = dra.kubelet.prepare([ref]).values()
        assert answer.error == ""
        dra.board.set("GPU-00000001", False, "XID 79")
        for stream in streams:
            update = next(stream).devices
            assert {d.device.device_name for d in update if d.health == health_pb2.UNHEALTHY} == {
                "gpu-1"
            }
    finally:
        for stream in streams:
            stream.cancel()
        channel.close()


# -- issue 32.19: devices are offered only once the kubelet can prepare them ----------


def _slice_keys(api: KubeApiDouble) -> list[str]:
    return sorted(key for key in api.objects if "/resourceslices/" in key)


def test_slices_wait_for_the_kubelets_registration_and_return_on_re_registration(
    short_tmp: Path, api: KubeApiDouble
) -> None:
    # a long resync: only the registration itself may prompt the publishing
    node = DraNode(short_tmp, api, dra_resync_seconds=3600.0)
    try:
        part = node.build()
        part.start()
        node.part = part
        assert wait_until(lambda: part.publisher.waiting != "")
        assert _slice_keys(api) == []  # the kubelet cannot prepare yet: nothing offered
        ready, why = part.ready()
        assert not ready and "waiting for the kubelet to register the DRA plugin" in why
        assert node.kubelet.register() == "v1.DRAPlugin"
        assert wait_until(lambda: bool(_slice_keys(api)))
        assert wait_until(lambda: part.ready() == (True, "dra: slices published"))
        # a restarted kubelet deletes the node's slices and registers the plugin again
        for key in _slice_keys(api):
            api.delete(
                "ResourceSlice", key.rsplit("/", 1)[1], api_version="resource.k8s.io/v1"
            )
        assert _slice_keys(api) == []
        DraKubelet(node.kubelet_root).register()
        assert wait_until(lambda: bool(_slice_keys(api)))
    finally:
        node.stop()


def test_a_refused_registration_offers_nothing(short_tmp: Path, api: KubeApiDouble) -> None:
    node = DraNode(short_tmp, api)
    try:
        part = node.build()
        part.start()
        node.part = part
        with pytest.raises(RegistrationRefused):
            node.kubelet.register(versions=["v2.DRAPlugin"])
        assert part.publisher.wait_passes(2, 30)
        assert _slice_keys(api) == []
        assert "the kubelet refused the plugin" in part.ready()[1]
    finally:
        node.stop()
