"""Shared fixtures: a simulated node (GPUs in YAML), a stand-in kubelet, the daemon.

Everything talks over real unix sockets in a short temporary directory (socket
paths must stay under 108 bytes, so pytest's long tmp_path is not used for them).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from hypothesis import HealthCheck
from hypothesis import settings as hypothesis_settings
from kit.memhook import shared_hook

from gpushare.base import logs
from gpushare.config import Settings
from gpushare.daemon import Daemon
from gpushare.host.elf import stand_in
from gpushare.kube.podspecs import PodSpecBook
from gpushare.sim.apidouble import KubeApiDouble
from gpushare.sim.kubeletdouble import SimulatedKubelet

RTX_3090 = {"name": "NVIDIA GeForce RTX 3090", "memory_mib": 24259}
TESLA_P4 = {"name": "Tesla P4", "memory_mib": 7611}
CARD_4GIB = {"name": "Test 4GiB", "memory_mib": 4096}
H200 = {"name": "NVIDIA H200", "memory_mib": 143771}

# No per-example deadline: on a loaded 2-core machine an example's wall time says nothing
# about the code (tests that bound their work count it, never time it).
hypothesis_settings.register_profile(
    "gpushare", deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
hypothesis_settings.load_profile("gpushare")

#: The daemon's own log format (the DaemonSet's JSON lines, base/logs.py) for what runs
#: in this process: structlog's default console renderer (padding, colours, repr) cost
#: about a tenth of the CPU of the tests that drive the daemon in-process. Every level
#: is kept and each line goes to the current sys.stdout, as with structlog's defaults;
#: tests that read log events use ``structlog.testing.capture_logs``, which replaces
#: the processors and so does not depend on the renderer.
structlog.configure(
    processors=logs.processors(structlog.processors.JSONRenderer()),
    wrapper_class=structlog.make_filtering_bound_logger(logging.NOTSET),
    logger_factory=structlog.PrintLoggerFactory(),
    cache_logger_on_first_use=False,
)


def scratch_root() -> str:
    """Where the tests' scratch files go: ``GPUSHARE_TEST_TMPDIR`` if set, else
    ``/dev/shm`` where it is a writable file system with room (1 GiB) mounted without
    noexec, nosuid or nodev (so compiled stand-ins run and modes mean what they mean),
    else ``/tmp``. Tests make and delete thousands of directories (the tenant-directory
    trees): on a disk-backed /tmp that is seconds of waiting for the disk per test, on a
    RAM-backed one none. No test observes durability (nothing can pull the power in a
    test). The simulated node (``short_tmp``: the kubelet's directory and sockets, the
    host directories) stays on /tmp, a disk as on a node: on tmpfs every new kubelet.sock
    gets a new inode, which changes the re-registration path a kubelet restart takes
    (tests/doors/deviceplugin/test_registration.py's restart test then fails one run in
    two)."""
    chosen = os.environ.get("GPUSHARE_TEST_TMPDIR", "")
    if chosen:
        return chosen
    try:
        info = os.statvfs("/dev/shm")
    except OSError:
        return "/tmp"
    unusable = os.ST_NOEXEC | os.ST_NOSUID | os.ST_NODEV | os.ST_RDONLY
    room = info.f_bavail * info.f_frsize >= 1 << 30
    if info.f_flag & unusable or not room or not os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/tmp"
    return "/dev/shm"


#: The root of the suite's scratch files: pytest's ``tmp_path``, ``tempfile``'s default
#: here and, through TMPDIR, in the programs the tests start
#: (set by :func:`pytest_configure`; /tmp for the e2e suite, whose real runtime and
#: control plane keep the machine's own temporary directory).
SCRATCH = "/tmp"


def pytest_configure(config: pytest.Config) -> None:
    global SCRATCH
    args = [str(arg) for arg in config.args]
    if config.getoption("markexpr", "").strip() == "e2e" or any("e2e" in a for a in args):
        return
    SCRATCH = scratch_root()
    tempfile.tempdir = SCRATCH
    os.environ["TMPDIR"] = SCRATCH


def nvml_loads() -> bool:
    """Whether a real NVIDIA driver answers here (tests marked ``gpu`` need one)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    return True


def gpu_uuid(i: int) -> str:
    return f"GPU-{i:08x}-0000-4000-8000-{i:012x}"


def cards(model: dict[str, Any], count: int, **extra: Any) -> list[dict[str, Any]]:
    return [{"uuid": gpu_uuid(i), **model, "numa_node": i % 2, **extra} for i in range(count)]


class Node:
    """A simulated node: GPUs file, kubelet stand-in and (once started) the daemon."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.gpus_file = root / "node.yaml"
        self.library = root / "libvgpu.so"
        self.library.write_bytes(stand_in(b"fake interposer for tests\n"))
        self.settings = Settings(
            kubelet_dir=str(root / "dp"),
            pod_resources_socket=str(root / "pr" / "kubelet.sock"),
            simulate=str(self.gpus_file),
            library=str(self.library),
            host_lib_dir=str(root / "vgpu"),
            dra_cdi_dir=str(root / "cdi-own"),  # the daemon's own CDI specs (grants, claims)
            memory_hook=str(shared_hook()),  # the driver hook and DRA claims' limit check
            metrics_port=0,
        )
        self.kubelet = SimulatedKubelet(
            Path(self.settings.kubelet_dir), Path(self.settings.pod_resources_socket)
        )
        self.daemon: Daemon | None = None
        self.specs: PodSpecBook | None = None

    def with_pod_specs(self) -> PodSpecBook:
        """Give the daemon pod specs, as the API server watch would. Tests write every
        pod into the book before the kubelet sees it, so a re-read on a miss (what the
        daemon's pod watch does) would find nothing new: it "succeeds" at once."""
        self.specs = PodSpecBook(self.settings.resource_prefix)
        self.specs.on_miss = lambda: True
        return self.specs

    def pod(self, name: str, requests: dict[str, int], container: str = "main") -> dict[str, Any]:
        """A pending pod asking ``requests``, recorded in the spec book if there is one."""
        pod = {
            "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
            "spec": {
                "containers": [
                    {
                        "name": container,
                        "resources": {"limits": {k: str(v) for k, v in requests.items()}},
                    }
                ]
            },
            "status": {"phase": "Pending"},
        }
        if self.specs is not None:
            self.specs.update(pod)
        return pod

    @property
    def memory(self) -> str:
        return self.settings.memory_resource

    @property
    def core(self) -> str:
        return self.settings.core_resource

    def write_gpus(self, gpus: list[dict[str, Any]]) -> None:
        self.gpus_file.write_text(yaml.safe_dump({"gpus": gpus}))

    def start(self, gpus: list[dict[str, Any]], **overrides: Any) -> Daemon:
        self.write_gpus(gpus)
        self.settings = replace(self.settings, **overrides)
        self.kubelet.start()
        # the kubelet's version, as the API link would read it from the Node
        self.daemon = Daemon(
            self.settings, specs=self.specs, kubelet_version=lambda: self.kubelet.version
        )
        self.daemon.start()
        assert self.wait_registered(), "the plugin did not register both resources"
        return self.daemon

    def socket(self, resource: str) -> Path:
        """Where the kubelet reaches the plugin for ``resource`` (a full resource name):
        its registration's endpoint, as the kubelet finds it (each daemon instance names
        its sockets for itself)."""
        path = self.kubelet.endpoint_socket(resource)
        assert path is not None, f"{resource} is not registered"
        return path

    def wait_registered(self, timeout: float = 30.0) -> bool:
        return self.kubelet.wait_for(
            lambda k: bool(k.devices(self.memory)) and bool(k.devices(self.core)), timeout
        )

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
        self.kubelet.stop()


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def node(short_tmp: Path) -> Iterator[Node]:
    sim = Node(short_tmp)
    try:
        yield sim
    finally:
        sim.stop()


#: The node the API-server double knows, for tests of the daemon's API link.
NODE = "gpu-node-1"


@pytest.fixture
def api(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeApiDouble]:
    """An API-server double holding the Node ``NODE``, the daemon's kubeconfig on it."""
    double = KubeApiDouble()
    double.start()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(double.kubeconfig(short_tmp / "kubeconfig")))
    double.add({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": {}}})
    try:
        yield double
    finally:
        double.stop()
