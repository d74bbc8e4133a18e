"""The processes the benchmark runs: a temporary simulated node (the GPU file, the
kubelet stand-in, the real daemon process) and the API-server double in a process of
its own."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from gpushare._proto.deviceplugin.v1beta1 import api_pb2
from gpushare.gpu.gpus import Gpu
from gpushare.host.elf import stand_in
from gpushare.share.devices import Resource
from gpushare.sim.kubeletdouble import SimulatedKubelet

PREFIX = "gpushare.io"
MEMORY = Resource.MEMORY.name_with(PREFIX)
CORE = Resource.CORE.name_with(PREFIX)
H200_MIB = 143771
BIG_CARD_MIB = 192 * 1024
BIG_CARDS = 16
KUBELET_LIMIT = 4 << 20
MIB = 1 << 20


def gpu_uuid(i: int) -> str:
    return f"GPU-{i:08x}-0000-4000-8000-{i:012x}"


def node_gpus(count: int, memory_mib: int, name: str = "NVIDIA H200") -> list[Gpu]:
    return [
        Gpu(uuid=gpu_uuid(i), name=name, memory_mib=memory_mib, index=i, minor=i, numa_node=i % 2)
        for i in range(count)
    ]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def container_needs(i: int) -> tuple[int, int]:
    """(memory units, core units) of the i-th container: 1-8 GiB and 5-20 % of a card."""
    return 4 + (i * 7) % 28, 5 + (i * 3) % 16


def container_order(i: int) -> list[str]:
    """Core first in three admissions of four, as the kubelet mostly does."""
    return [MEMORY, CORE] if i % 4 == 3 else [CORE, MEMORY]


def end_on_stdin_close(proc: subprocess.Popen[Any], grace: float = 10.0) -> None:
    """End a helper process that runs until its standard input closes (the API-server
    doubles' ``python -m`` mains, the DRA call worker): close it, and kill the process
    if it has not ended ``grace`` seconds later."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


NODE_NAME = "bench-node"


class ApiServer:
    """The API-server double in a process of its own, so that serving the daemon's
    watch and patches costs this process (which times the calls) nothing."""

    def __init__(self, root: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpushare.sim.apidouble"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        url = self.proc.stdout.readline().decode().strip()
        if not url.startswith("http://127.0.0.1:"):
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the API-server double did not start: {url!r}")
        self.port = int(url.rsplit(":", 1)[1])
        self._conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        self.kubeconfig = root / "kubeconfig"
        cluster = {"name": "double", "cluster": {"server": url}}
        context = {"name": "double", "context": {"cluster": "double", "user": "bench"}}
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "double",
                    "clusters": [cluster],
                    "contexts": [context],
                    "users": [{"name": "bench", "user": {"token": "bench"}}],
                }
            )
        )
        self.call("POST", "/api/v1/nodes", {"metadata": {"name": NODE_NAME}})
        self.pods_created = self.pods_deleted = 0

    def call(self, method: str, path: str, body: Any = None) -> int:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data else {}
        self._conn.request(method, path, body=data, headers=headers)
        response = self._conn.getresponse()
        response.read()
        return response.status

    def add_pod(self, name: str, requests: dict[str, int]) -> None:
        limits = {resource: str(units) for resource, units in requests.items()}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": "default"},
            "spec": {
                "nodeName": NODE_NAME,
                "containers": [{"name": "main", "resources": {"limits": limits}}],
            },
            "status": {"phase": "Pending"},
        }
        if self.call("POST", "/api/v1/namespaces/default/pods", pod) == 201:
            self.pods_created += 1

    def delete_pod(self, name: str) -> None:
        if self.call("DELETE", f"/api/v1/namespaces/default/pods/{name}") == 200:
            self.pods_deleted += 1

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "KUBERNETES_SERVICE_HOST"}
        return env | {"NODE_NAME": NODE_NAME, "KUBECONFIG": str(self.kubeconfig)}

    def stop(self) -> None:
        self._conn.close()
        if self.proc.poll() is None:
            end_on_stdin_close(self.proc)


class Node:
    """A temporary simulated node: the GPU file, the kubelet stand-in, the daemon process,
    and the API-server double it talks to."""

    def __init__(self, root: Path, cards: int, observe: Any = None) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.gpus_file = root / "node.yaml"
        self.gpus_file.write_text(
            yaml.safe_dump(
                {
                    "gpus": [
                        {
                            "uuid": gpu.uuid,
                            "name": gpu.name,
                            "memory_mib": gpu.memory_mib,
                            "numa_node": gpu.numa_node,
                        }
                        for gpu in node_gpus(cards, H200_MIB)
                    ]
                }
            )
        )
        self.library = root / "libvgpu.so"
        self.library.write_bytes(stand_in(b"stand-in interposer for the benchmark\n"))
        self.kubelet = SimulatedKubelet(root / "dp", root / "pr" / "kubelet.sock", observe)
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = root / "daemon.log"
        self.serial = 0
        self.live: deque[str] = deque()
        self._host_dir: Path | None = None
        self.api = ApiServer(root)
        self.admissions: list[float] = []  # seconds per whole admission (four calls)

    def host_dir(self) -> Path:
        """Where the daemon writes cache directories: not under /tmp, whose metadata
        operations are many times slower than the rest of the disk on some machines
        (this one: mkdir 0.24 ms and file creation 1 ms in /tmp, 0.02 ms in /var/tmp)."""
        if self._host_dir is None:
            base = "/var/tmp" if os.path.isdir("/var/tmp") else None
            self._host_dir = Path(tempfile.mkdtemp(prefix="gsb-vgpu-", dir=base))
        return self._host_dir

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "gpushare.daemon",
            "--kubelet-dir",
            str(self.root / "dp"),
            "--pod-resources-socket",
            str(self.root / "pr" / "kubelet.sock"),
            "--simulate",
            str(self.gpus_file),
            "--library",
            str(self.library),
            "--host-lib-dir",
            str(self.host_dir()),
            "--metrics-port",
            str(free_port()),
            "--metrics-address",
            "127.0.0.1",
            "--log-format",
            "json",
        ]

    def start(self, timeout: float = 30.0) -> float:
        """Start the daemon; seconds from process start to both device lists received."""
        self.kubelet.start()
        with self.log.open("ab") as log:
            started = time.perf_counter()
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=log, env=self.api.env())
        ok = self.kubelet.wait_for(
            lambda k: bool(k.devices(MEMORY)) and bool(k.devices(CORE)), timeout
        )
        elapsed = time.perf_counter() - started
        if not ok:
            raise RuntimeError(f"the daemon did not register within {timeout} s; see {self.log}")
        return elapsed

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.kubelet.stop()
        self.api.stop()
        if self._host_dir is not None:
            shutil.rmtree(self._host_dir, ignore_errors=True)

    def admit_next(self, window: int) -> tuple[str, str]:
        """Admit the next container (both resources); release the oldest beyond ``window``.

        Returns the cards its memory and core units are on."""
        i = self.serial
        self.serial += 1
        memory, core = container_needs(i)
        pod = f"pod-{i}"
        self.api.add_pod(pod, {MEMORY: memory, CORE: core})  # bound just before admission
        started = time.perf_counter()
        admitted = self.kubelet.admit(
            pod, "main", {MEMORY: memory, CORE: core}, order=container_order(i)
        )
        self.admissions.append(time.perf_counter() - started)
        self.live.append(pod)
        while len(self.live) > window:
            gone = self.live.popleft()
            self.kubelet.release(gone)
            self.api.delete_pod(gone)
        return (
            admitted.devices[MEMORY][0].rpartition("::")[0],
            admitted.devices[CORE][0].rpartition("::")[0],
        )

    def baseline_call(self) -> float:
        endpoint = self.kubelet.endpoints[MEMORY]
        started = time.perf_counter()
        endpoint.stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=10)
        return time.perf_counter() - started


@contextlib.contextmanager
def temporary_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="gsb-", dir="/tmp"))  # socket paths stay short
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def process_handle(pid: int) -> Any:
    import psutil

    return psutil.Process(pid)
