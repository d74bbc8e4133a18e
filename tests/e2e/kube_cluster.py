"""A real Kubernetes cluster on loopback for the e2e tests, driven the way an operator would.

Everything here talks to the components through their public interfaces only: the API
server's REST API, the kubelet's device-plugin directory and PodResources socket (through the
real gpushare daemon, a console script), and the CRI fake's record of created containers. The
daemon, the extender and kubectl-gpushare run as processes; the one gpushare module imported
is gpushare.sim.controlplane, for the etcd and kube-apiserver command lines (the same ones
the DRA tests, make bench and make scale start).

Layout of one cluster (all under one short temporary directory, so sockets fit in 108 bytes):

    etcd/ apiserver/ (cert-dir, logs) tokens.csv sa.key admin.kubeconfig
    node-1/kubelet/   bind-mounted over /var/lib/kubelet in node-1's mount namespace
    node-1/vgpu/      the daemon's --host-lib-dir
    node-1/cri.sock   the CRI fake; node-1/containers.jsonl what it was asked to create
    node-1/gpus.yaml  the simulated cards (--simulate)
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import requests
import urllib3
import yaml
from local_image import IMAGE, environ, make_image, report_sections
from real_runtime import CNI_BIN, CNI_PLUGINS, RUNTIME_BIN, RUNTIME_PROGRAMS, Containerd

from gpushare.sim import controlplane

REPO = Path(__file__).resolve().parents[2]
#: The Kubernetes minor the suite runs on: 1.36 (e2e/bin) or 1.37 (e2e/bin-1.37), as
#: `make e2e K8S_VERSION=...` builds them (e2e/build.sh).
K8S_VERSION = os.environ.get("K8S_VERSION", "1.36")
#: The harness binaries `make e2e` builds; $GPUSHARE_E2E_BIN names another folder.
BIN = Path(
    os.environ.get("GPUSHARE_E2E_BIN")
    or REPO / "e2e" / ("bin" if K8S_VERSION == "1.36" else f"bin-{K8S_VERSION}")
)
#: The console scripts of the repository's virtual environment (the one running pytest).
SCRIPTS = Path(sys.executable).parent
#: The daemon and kubectl-gpushare import this checkout's code, whatever checkout the
#: venv's editable install names (a git worktree shares the main checkout's venv).
CHECKOUT_SRC = str(REPO / "src")

PREFIX = "gpushare.io"
#: the daemon's --host-lib-dir default and the DaemonSet's hostPath (NodeSpec.host_lib_dir)
HOST_LIB_DIR = "/usr/local/vgpu"
MEMORY = f"{PREFIX}/vcuda-memory"
CORE = f"{PREFIX}/vcuda-core"
WHOLE = f"{PREFIX}/gpu"

#: Feature gates given to every component (all beta and on by default in 1.36; named so that a
#: version bump that changes a default shows up here rather than as a silent behaviour change).
FEATURE_GATES = {
    "DRAConsumableCapacity": True,
    "DRAPartitionableDevices": True,
    "DRAExtendedResource": True,
    "DRADeviceTaints": True,
}


#: Node credentials exist for node-1 .. node-<SPARE_NODES> besides the nodes the cluster starts
#: with, so that a test can add a node (Cluster.add_node) to the running cluster.
SPARE_NODES = 8

T = TypeVar("T")


class E2EError(AssertionError):
    """Something the cluster did not do within its deadline (a test failure, with context)."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _accepts(path: Path) -> bool:
    """Whether something listens on the unix socket ``path`` (a connect succeeds)."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, step: float = 0.1) -> T:
    """Re-run ``probe`` until it returns something truthy or ``timeout`` passes (then fail,
    naming ``what`` and the last exception the probe raised, if any)."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            value = probe()
            if value:
                return value
        except (requests.RequestException, OSError, KeyError, ValueError) as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise E2EError(
                f"timed out after {timeout:.0f} s waiting for {what}; last error: {last!r}"
            )
        time.sleep(step)


def stub_library(path: Path) -> None:
    """An ELF header of a 64-bit little-endian shared object for this machine (x86-64 or
    aarch64), and nothing else: what the daemon checks of the interposer library it installs
    (never loaded here)."""
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    et_dyn, ev_current = 3, 1
    e_machine = {"aarch64": 183, "arm64": 183}.get(platform.machine().lower(), 62)
    header = ident + et_dyn.to_bytes(2, "little") + e_machine.to_bytes(2, "little")
    header += ev_current.to_bytes(4, "little") + bytes(64 - 24)
    path.write_bytes(header + b"gpushare e2e stand-in for libvgpu.so\n")


# --------------------------------------------------------------------------- processes

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies, however it dies (kept
    across exec, so nsenter's and unshare's programs get it too). Nothing outlives pytest."""
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Proc:
    """One process the harness started, its output in ``log``; stopped with deadlines."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None):
        self.name = name
        self.argv = argv
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._out = log.open("ab")
        self._out.write(f"\n=== {time.strftime('%H:%M:%S')} {' '.join(argv)}\n".encode())
        self._out.flush()
        self.popen = subprocess.Popen(
            argv,
            # Never the caller's directory: a program that removes relative paths (the
            # kubelet unlinks "bin", see NodeAgent._in_namespace) touches only its own files.
            cwd=log.parent,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.popen.pid, sig)

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL once ``grace`` passes; waits for the process either way."""
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
        self._out.close()
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL to the process, wait until it is gone (it cannot ignore it)."""
        self.signal(signal.SIGKILL)
        self.popen.wait(30)

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


# --------------------------------------------------------------------------- the API


class Api:
    """A small REST client of the API server (requests; one bearer token)."""

    def __init__(self, server: str, token: str, ca: Path) -> None:
        self.server = server
        self.token = token
        self.session = requests.Session()
        # Not the environment's CA bundle (REQUESTS_CA_BUNDLE would win over `verify`) nor
        # its proxies: this cluster's own CA, on loopback.
        self.session.trust_env = False
        self.session.headers["Authorization"] = f"Bearer {token}"
        # The API server's self-signed serving certificate (its --cert-dir) is for 127.0.0.1.
        self.session.verify = str(ca)
        self._resources: dict[tuple[str, str], tuple[str, bool]] = {}

    def as_token(self, token: str) -> Api:
        other = Api(self.server, token, Path(str(self.session.verify)))
        other._resources = self._resources
        return other

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", 30)
        return self.session.request(method, self.server + path, **kwargs)

    def get(self, path: str, **params: Any) -> dict[str, Any]:
        reply = self.request("GET", path, params=params)
        reply.raise_for_status()
        return dict(reply.json())

    def get_or_none(self, path: str) -> dict[str, Any] | None:
        reply = self.request("GET", path)
        if reply.status_code == 404:
            return None
        reply.raise_for_status()
        return dict(reply.json())

    def post(self, path: str, body: dict[str, Any], **params: Any) -> requests.Response:
        return self.request("POST", path, json=body, params=params)

    def patch(self, path: str, body: dict[str, Any], kind: str = "merge") -> requests.Response:
        types = {
            "merge": "application/merge-patch+json",
            "strategic": "application/strategic-merge-patch+json",
            "json": "application/json-patch+json",
        }
        return self.request(
            "PATCH", path, data=json.dumps(body), headers={"Content-Type": types[kind]}
        )

    def delete(self, path: str, **params: Any) -> requests.Response:
        return self.request("DELETE", path, params=params)

    # Paths of objects, from the server's own discovery documents.
    def resource(self, api_version: str, kind: str) -> tuple[str, bool]:
        """(collection path prefix, namespaced) of ``kind`` in ``api_version``."""
        key = (api_version, kind)
        if key not in self._resources:
            base = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            for item in self.get(base)["resources"]:
                if "/" not in item["name"]:
                    self._resources[(api_version, item["kind"])] = (
                        f"{base}/{item['name']}",
                        bool(item["namespaced"]),
                    )
        if key not in self._resources:
            raise KeyError(f"the API server serves no {kind} in {api_version}")
        return self._resources[key]

    def path(self, obj: dict[str, Any], named: bool = True) -> str:
        base, namespaced = self.resource(obj["apiVersion"], obj["kind"])
        meta = obj.get("metadata", {})
        if namespaced:
            ns = meta.get("namespace", "default")
            prefix, plural = base.rsplit("/", 1)
            base = f"{prefix}/namespaces/{ns}/{plural}"
        return f"{base}/{meta['name']}" if named else base

    def create(self, obj: dict[str, Any], dry_run: bool = False) -> requests.Response:
        params = {"dryRun": "All"} if dry_run else {}
        return self.post(self.path(obj, named=False), obj, **params)

    def apply(self, obj: dict[str, Any], dry_run: bool = False) -> requests.Response:
        """Server-side apply (what `kubectl apply --server-side` sends)."""
        params: dict[str, str] = {"fieldManager": "gpushare-e2e", "force": "true"}
        if dry_run:
            params["dryRun"] = "All"
        return self.request(
            "PATCH",
            self.path(obj),
            data=json.dumps(obj),
            params=params,
            headers={"Content-Type": "application/apply-patch+yaml"},
        )

    def apply_all(self, objects: Iterable[dict[str, Any]]) -> None:
        for obj in objects:
            reply = self.apply(obj)
            if reply.status_code >= 300:
                raise E2EError(
                    f"apply {obj['kind']}/{obj['metadata']['name']}: "
                    f"{reply.status_code} {reply.text[:500]}"
                )


def find_proto(relative: str) -> Path:
    """The repository's copy of a Kubernetes proto (``proto/<relative>``, or wherever it was
    moved to inside the repository)."""
    default = REPO / "proto" / relative
    if default.exists():
        return default
    for path in sorted(REPO.rglob(relative)):
        if ".venv" not in path.parts and "site-packages" not in path.parts:
            return path
    raise E2EError(f"no {relative} in {REPO}")


def load_manifests(*paths: Path) -> list[dict[str, Any]]:
    """Every object of the YAML files (documents that are empty or kustomizations left out)."""
    objects = []
    for path in paths:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") != "Kustomization":
                objects.append(doc)
    return objects


# --------------------------------------------------------------------------- nodes


@dataclass
class NodeSpec:
    """A node of the cluster: its name, its simulated cards and the daemon's extra flags."""

    name: str
    gpus: list[dict[str, Any]]
    daemon_args: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=lambda: {f"{PREFIX}/enabled": "true"})
    #: more top-level keys of the simulated node file beside ``gpus`` (``driver_version``,
    #: ``nvml_library``: the simulated NVML of docs/simulation.md)
    node_file: dict[str, Any] = field(default_factory=dict)
    #: a cgroup v2 hierarchy for the node's containers: the kernel's own, mounted at
    #: ``<node>/cgroup`` inside the node's mount namespace (a machine whose /sys/fs/cgroup is
    #: v1 has it too, unmounted), with the CRI fake run in that namespace and told to put
    #: each container's process in ``<node>/cgroup/k8s.io/<container id>`` (containerd's path)
    cgroup2: bool = False
    #: the node's container runtime: ``crifake`` (Kubernetes' CRI fake, recording each
    #: container's config) or ``containerd`` (real containerd and runc, tests/e2e/real_runtime.py:
    #: containers really run, read from inside through their logs)
    runtime: str = "crifake"
    #: the DaemonSet's host directory ``/usr/local/vgpu`` in the node's namespace: the node's
    #: ``vgpu`` directory bound there as a SHARED mount (the cache-fs init container's
    #: Bidirectional mount needs one: containerd refuses a private source), so that a
    #: DaemonSet run by the node's containerd finds its hostPath there and not the host's
    host_lib_dir: bool = False
    #: on a real runtime, a pod network (real CNI plugins, tests/e2e/real_runtime.py: pods off
    #: the host network get a sandbox) and a node address the API server reaches the kubelet
    #: at (:meth:`Cluster.give_node_address`: pods' logs through the API server, as `kubectl
    #: logs` and `kubectl gpushare verify` read them)
    pod_network: bool = False


class NodeAgent:
    """One node: a private mount namespace holding the kubelet and the gpushare daemon.

    In the namespace a tmpfs covers ``/var/lib`` (the host's stays as it is: nothing is
    created, changed or removed on the host, and clusters of other checkouts running at the
    same time cannot pull a mount point from under this one) and the node's own directory is
    bind-mounted on ``/var/lib/kubelet``, so the kubelet and the daemon use their default
    paths (device-plugins, pod-resources, plugins_registry), as on a real node, and several
    nodes share this machine. The daemon's --host-lib-dir is the node's ``vgpu`` directory.
    The CRI fake runs outside it (a socket in the node's directory)."""

    def __init__(self, cluster: Cluster, spec: NodeSpec, kubelet_port: int, healthz_port: int):
        self.cluster = cluster
        self.spec = spec
        self.name = spec.name
        self.dir = cluster.dir / spec.name
        self.root = self.dir / "kubelet"  # /var/lib/kubelet inside the namespace
        self.vgpu = self.dir / "vgpu"  # the daemon's --host-lib-dir
        self.cwd = self.dir / "cwd"  # the working directory of its programs: kept empty
        self.records_file = self.dir / "containers.jsonl"
        self.cri_socket = self.dir / "cri.sock"
        self.gpus_file = self.dir / "gpus.yaml"
        self.cgroup = self.dir / "cgroup"  # the cgroup v2 mount in the namespace (cgroup2)
        self.kubelet_port = kubelet_port
        self.healthz_port = healthz_port
        self.holder: Proc | None = None
        self.cri: Proc | None = None
        self.kubelet: Proc | None = None
        self.daemon: Proc | None = None
        self.daemon_metrics_port = 0
        self.daemon_pod = f"gpushare-{self.name}"
        self.daemon_extra: list[str] = []  # the running daemon's extra flags
        self.extra: list[Proc] = []  # what spawn() started
        #: the node's containerd (``runtime="containerd"``), else None
        self.containerd: Containerd | None = (
            Containerd(self) if spec.runtime == "containerd" else None
        )
        if self.containerd is not None:
            self.cri_socket = self.containerd.socket

    # ---- the namespace
    def _start_namespace(self) -> None:
        for d in (self.root, self.vgpu, self.cwd, self.cgroup):
            d.mkdir(parents=True, exist_ok=True)
        ready = self.dir / "namespace-ready"
        # A node of this name may have run before in this cluster (test_dra's node-3, then
        # test_whole_and_mig's): its marker would end the wait below before this namespace's
        # mounts are made, and the kubelet would start on the host's /var/lib.
        ready.unlink(missing_ok=True)
        # With cgroup2: the kernel's cgroup v2 hierarchy on <node>/cgroup, seen only in the
        # namespace (a private mount, gone with it); its directories are the machine's.
        script = (
            "mount -t tmpfs -o mode=0755 gpushare-e2e /var/lib && mkdir /var/lib/kubelet "
            '&& mount --bind "$1" /var/lib/kubelet '
            '&& { [ -z "$4" ] || mount -t cgroup2 gpushare-e2e "$4"; } '
            '&& { [ -z "$5" ] || { mount -t tmpfs -o mode=0755 gpushare-e2e /var/log '
            "&& mkdir -p /run/containerd "
            "&& mount -t tmpfs -o mode=0700 gpushare-e2e /run/containerd; }; } "
            '&& { [ -z "$6" ] || { mkdir -p "$6" && mount --bind "$2" "$6" '
            '&& mount --make-shared "$6"; }; } '
            '&& touch "$3" && exec sleep infinity'
        )
        self.holder = Proc(
            "namespace",
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "--",
                "sh",
                "-c",
                script,
                "sh",
                str(self.root),
                str(self.vgpu),
                str(ready),
                str(self.cgroup) if self.spec.cgroup2 else "",
                # a real runtime's pod logs (/var/log/pods) stay in the node, and so do the
                # paths containerd and its shim fix whatever the config says (the IO fifos'
                # /run/containerd/fifo, the shim's fallback runc root /run/containerd/runc):
                # on the host at most the empty mount point /run/containerd
                "log" if self.containerd is not None else "",
                # the DaemonSet's hostPath, on the node's vgpu directory (the host's
                # /usr/local/vgpu is only the mount point, made if missing: nothing is
                # written in it)
                HOST_LIB_DIR if self.spec.host_lib_dir else "",
            ],
            self.dir / "namespace.log",
        )
        wait_for(f"{self.name}'s mount namespace", lambda: ready.exists() or self._dead(), 60)
        if not self.holder.alive():
            raise E2EError(f"{self.name}: the mount namespace did not start:\n{self.holder.tail()}")

    def _dead(self) -> bool:
        return self.holder is not None and not self.holder.alive()

    def _in_namespace(self, argv: list[str]) -> list[str]:
        """``argv`` run in the node's mount namespace, in an empty directory of its own
        (``<node>/cwd``). Entering a mount namespace moves the working directory to ``/``, and
        when a pod is deleted the kubelet (on the CRI fake) unlinks the entries of its working
        directory one by one, alphabetically, until one fails (strace: ``unlinkat(AT_FDCWD,
        "containers.jsonl")``, ``"cri.sock"``, ``"crifake.log"``, ... ``"kubelet"`` EBUSY): from
        ``/`` that is the ``/bin`` link of a merged-/usr host, from the node's directory it is
        the CRI socket and the records. In an empty directory it finds nothing to remove."""
        assert self.holder is not None
        return [
            "nsenter",
            "--target",
            str(self.holder.pid),
            "--mount",
            f"--wd={self.cwd}",
            "--",
            *argv,
        ]

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        """Run another program on this node, in its mount namespace (it sees the node's
        /var/lib/kubelet: plugins_registry/, plugins/, device-plugins/, pod-resources/), its
        output in ``<node>/<name>.log``; stopped with the node. For a DRA driver, say, with
        ``cluster.node_kubeconfig(node)`` or a token of its own. ``env`` replaces the
        environment (PATH and HOME are added when missing)."""
        full = dict(env) if env is not None else dict(os.environ)
        full.setdefault("PATH", f"{SCRIPTS}:{os.environ.get('PATH', '/usr/bin:/bin')}")
        full.setdefault("HOME", str(self.dir))
        proc = Proc(name, self._in_namespace(argv), self.dir / f"{name}.log", env=full)
        self.extra.append(proc)
        return proc

    # ---- the CRI fake and the kubelet
    @property
    def cdi_dir(self) -> Path:
        """The node's CDI spec directory: the CRI fake resolves names there; a daemon writes
        its own specs there with ``--dra-cdi-dir``."""
        return self.dir / "cdi"

    def _start_cri(self) -> None:
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        if self.containerd is not None:
            self._start_containerd()
            return
        argv = [
            str(BIN / "crifake"),
            "--socket",
            str(self.cri_socket),
            "--record",
            str(self.records_file),
            # the node's credentials: it reads its pods to let init containers finish
            "--kubeconfig",
            str(self.cluster.node_kubeconfig(self.name)),
            # the node's CDI specs (the daemons write theirs there): the CDI names the
            # kubelet passes are resolved and applied, their createRuntime hooks run
            "--cdi-dirs",
            str(self.cdi_dir),
        ]
        if self.spec.cgroup2:  # in the namespace, where <node>/cgroup is cgroup v2
            argv = self._in_namespace([*argv, "--cgroup-root", str(self.cgroup)])
        # a socket left by an earlier node of this name is no sign of this one listening
        self.cri_socket.unlink(missing_ok=True)
        self.cri = Proc("crifake", argv, self.dir / "crifake.log")
        cri = self.cri
        wait_for(
            f"{self.name}'s CRI fake",
            lambda: self.cluster._alive(cri) and _accepts(self.cri_socket),
            60,
        )

    def _start_containerd(self) -> None:
        """containerd in the node's namespace, then the e2e image imported (pinned as the
        sandbox image: nothing is ever pulled)."""
        assert self.containerd is not None
        missing = [b for b in RUNTIME_PROGRAMS if not (RUNTIME_BIN / b).exists()]
        if self.spec.pod_network:
            missing += [f"cni/{b}" for b in CNI_PLUGINS if not (CNI_BIN / b).exists()]
        if missing:
            raise E2EError(f"missing {missing} in {RUNTIME_BIN}: run `make e2e-build`")
        config = self.containerd.write_config()
        self.cri_socket.unlink(missing_ok=True)
        self.cri = Proc(
            "containerd",
            self._in_namespace([str(RUNTIME_BIN / "containerd"), "--config", str(config)]),
            self.dir / "containerd.log",
            env=self.containerd.env(),
        )
        cri = self.cri
        wait_for(
            f"{self.name}'s containerd",
            lambda: self.cluster._alive(cri) and _accepts(self.cri_socket),
            60,
        )
        self.containerd.import_image(self.cluster.image_tar())

    def _write_kubelet_config(self) -> Path:
        endpoint = f"unix://{self.cri_socket}"
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": "127.0.0.1",
            "port": self.kubelet_port,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            "authentication": {
                "anonymous": {"enabled": True},
                "webhook": {"enabled": False},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "containerRuntimeEndpoint": endpoint,
            "imageServiceEndpoint": endpoint,
            "failSwapOn": False,
            "failCgroupV1": False,
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            "cgroupDriver": "cgroupfs",
            "resolvConf": "",
            "registerNode": True,
            "nodeStatusUpdateFrequency": "2s",
            "nodeStatusReportFrequency": "2s",
            "syncFrequency": "5s",
            "serializeImagePulls": False,
            "localStorageCapacityIsolation": False,
            "evictionHard": {
                "memory.available": "1Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "featureGates": dict(FEATURE_GATES),
        }
        path = self.dir / "kubelet-config.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start_kubelet(self) -> None:
        config = self._write_kubelet_config()
        self.kubelet = Proc(
            "kubelet",
            self._in_namespace(
                [
                    str(BIN / "kubelet"),
                    "--config",
                    str(config),
                    "--kubeconfig",
                    str(self.cluster.node_kubeconfig(self.name)),
                    "--hostname-override",
                    self.name,
                    "--node-ip",
                    "127.0.0.1",
                    "--cert-dir",
                    str(self.dir / "kubelet-pki"),
                    "--node-labels",
                    ",".join(f"{k}={v}" for k, v in self.spec.labels.items()),
                    "-v",
                    "2",
                ]
            ),
            self.dir / "kubelet.log",
        )
        wait_for(f"{self.name}'s kubelet /healthz", self._kubelet_healthy, 90, step=0.25)

    def _kubelet_healthy(self) -> bool:
        if self.kubelet is not None and not self.kubelet.alive():
            raise E2EError(f"{self.name}: the kubelet exited:\n{self.kubelet.tail()}")
        try:
            reply = requests.get(f"http://127.0.0.1:{self.healthz_port}/healthz", timeout=2)
        except requests.RequestException:
            return False
        return reply.status_code == 200

    def stop_kubelet(self, grace: float = 10.0) -> None:
        if self.kubelet is not None:
            self.kubelet.stop(grace)
            self.kubelet = None

    def restart_kubelet(self) -> None:
        """Stop the kubelet (SIGTERM, KILL after a deadline) and start it again: it deletes
        and re-creates kubelet.sock, and a device plugin must register again."""
        daemon = self.daemon if self.daemon is not None and self.daemon.alive() else None
        shown = self.cluster.allocatable(self.name)
        served = [r for r in self.shared_resources() if int(shown.get(r, "0")) > 0]
        self.stop_kubelet()
        self.start_kubelet()
        self.cluster.wait_node_ready(self.name)
        if daemon is not None and served:
            # Ready is not re-registered: until the daemon registers with the new kubelet,
            # the kubelet knows no healthy device of it (its checkpoint restores none) and
            # refuses a pod the scheduler binds ("requested number of devices unavailable"),
            # while the Node still shows the old allocatable. Each shared resource it served
            # must be listed by the new kubelet's PodResources GetAllocatableResources.
            def registered() -> bool:
                if not daemon.alive():
                    raise E2EError(f"{self.name}: the daemon exited:\n{daemon.tail()}")
                listed = self.allocatable_devices()
                return all(listed.get(r, 0) > 0 for r in served)

            try:
                wait_for(
                    f"{self.name}'s daemon registered with the new kubelet", registered, 90, 0.5
                )
            except E2EError as exc:  # what each side did, for a failure seen only in CI
                raise E2EError(f"{exc}\n{self.registration_evidence(daemon)}") from None

    def registration_evidence(self, daemon: Proc) -> str:
        """The daemon's last log lines and the kubelet's lines about device plugins."""
        try:
            kubelet = [
                line
                for line in (self.dir / "kubelet.log").read_text(errors="replace").splitlines()
                if "plugin" in line.lower() or "endpoint" in line.lower()
            ][-40:]
        except OSError as exc:
            kubelet = [f"(no kubelet log: {exc})"]
        return (
            f"--- {self.name}: the daemon's last log lines\n{daemon.tail(60)}\n"
            f"--- {self.name}: the kubelet's lines naming a plugin or endpoint\n"
            + "\n".join(kubelet)
        )

    def shared_resources(self) -> tuple[str, str]:
        """(vcuda-memory, vcuda-core) with the daemon's resource prefix (its flags')."""
        flags = [*self.spec.daemon_args, *self.daemon_extra]
        prefix = PREFIX
        for i, flag in enumerate(flags):
            if flag == "--resource-prefix" and i + 1 < len(flags):
                prefix = flags[i + 1]
            elif flag.startswith("--resource-prefix="):
                prefix = flag.split("=", 1)[1]
        return f"{prefix}/vcuda-memory", f"{prefix}/vcuda-core"

    # ---- the daemon
    def write_gpus(self, gpus: list[dict[str, Any]]) -> None:
        self.gpus_file.write_text(yaml.safe_dump({"gpus": gpus, **self.spec.node_file}))

    def daemon_pod_manifest(self) -> dict[str, Any]:
        """The DaemonSet's own pod template (daemonset/daemonset.yaml), pinned to this node.
        Probes are left out: the CRI fake gives the pod no reachable address."""
        ds = next(
            o
            for o in load_manifests(REPO / "daemonset" / "daemonset.yaml")
            if o["kind"] == "DaemonSet"
        )
        template = ds["spec"]["template"]
        spec = dict(template["spec"])
        spec["nodeName"] = self.name
        containers = []
        for c in spec["containers"]:
            c = {k: v for k, v in c.items() if k not in ("livenessProbe", "readinessProbe")}
            containers.append(c)
        spec["containers"] = containers
        # The CRI fake never ends a container: an init container (the DaemonSet's
        # size-bounded tmpfs set-up) would keep the pod from Running. Its work is a mount in
        # the pod, which the daemon run here in the node's namespace does not use.
        spec.pop("initContainers", None)
        if self.containerd is not None:
            spec = self._stand_in_daemon_spec(spec)
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self.daemon_pod,
                "namespace": "kube-system",
                "labels": dict(template["metadata"]["labels"]),
            },
            "spec": spec,
        }

    def _stand_in_daemon_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        """On a real runtime, the daemon pod's container is the e2e image's report (the
        gpushare image and the DaemonSet run by containerd are issue 39's items 1 and 3): its
        env as the kubelet and containerd really gave it is read from its log, and the
        daemon then runs in the node's namespace with it, as on the fake. Its hostPath
        volumes are left out (they would be made on the host), the host network is used (no
        CNI here); the securityContext, resources and env sources are the template's."""
        containers = []
        for c in spec["containers"]:
            c = {k: v for k, v in c.items() if k not in ("volumeMounts", "ports")}
            c.update(image=IMAGE, imagePullPolicy="Never", command=["/bin/sh", "/report"])
            c.pop("args", None)
            containers.append(c)
        spec = {k: v for k, v in spec.items() if k != "volumes"}
        spec["containers"] = containers
        spec["hostNetwork"] = True
        return spec

    def _daemon_container_config(self) -> dict[str, Any]:
        """The daemon container's command, args and env: on the CRI fake from its record, on
        a real runtime from the template (command, args) and its report (env, as the
        container's process really got it)."""
        ns, pod = "kube-system", self.daemon_pod
        if self.containerd is None:
            return self.cluster.wait_record(self.name, ns, pod, "gpushare")
        container = next(
            c for c in self.daemon_pod_source()["containers"] if c["name"] == "gpushare"
        )
        report = self.cluster.wait_report(ns, pod, "gpushare")
        env = environ(report)
        for name in ("PATH", "HOSTNAME", "HOME"):  # the image's and the runtime's own
            env.pop(name, None)
        return {"command": container["command"], "args": container.get("args", []), "env": env}

    def daemon_pod_source(self) -> dict[str, Any]:
        """The DaemonSet's pod template spec, as written in daemonset/daemonset.yaml."""
        ds = next(
            o
            for o in load_manifests(REPO / "daemonset" / "daemonset.yaml")
            if o["kind"] == "DaemonSet"
        )
        return dict(ds["spec"]["template"]["spec"])

    def start_daemon(
        self, *extra: str, gpus: list[dict[str, Any]] | None = None, wait: bool = True
    ) -> Proc:
        """Run ``gpushare-device-plugin`` in the node's namespace as its DaemonSet pod would:
        the command, arguments and env the kubelet gave that pod's container (read from the
        CRI fake's record), a token bound to that pod (carrying the node's name), simulated
        cards, and ``extra`` flags. Waits until the Node shows the resources unless told not."""
        if self.daemon is not None and self.daemon.alive():
            raise E2EError(f"{self.name}: a daemon runs already")
        self.write_gpus(gpus if gpus is not None else self.spec.gpus)
        record = self._daemon_container_config()
        token = self.cluster.token_for_pod("kube-system", "gpushare", self.daemon_pod)
        kubeconfig = self.dir / "daemon.kubeconfig"
        self.cluster.write_kubeconfig(kubeconfig, token)
        env = {k: v for k, v in record["env"].items() if not k.startswith("KUBERNETES_")}
        env.update(
            {
                "PATH": f"{SCRIPTS}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                "KUBECONFIG": str(kubeconfig),
                "HOME": str(self.dir),
                "PYTHONPATH": CHECKOUT_SRC,
            }
        )
        library = self.dir / "libvgpu.so"
        stub_library(library)
        hook = self.dir / "gpushare-memory-hook"
        if not hook.exists():  # the DRA claims' limit check (and the driver hook) names it
            subprocess.run(
                ["gcc", "-O2", "-Wall", "-Wextra", "-o", str(hook),  # -Werror: the image's
                 str(REPO / "hook" / "memory-hook.c"), "-ldl"],
                check=True, timeout=120,
            )  # fmt: skip
        self.daemon_metrics_port = free_port()
        command = [*record["command"], *record["args"]]
        command[0] = str(SCRIPTS / Path(command[0]).name)
        argv = [
            *command,
            "--simulate",
            str(self.gpus_file),
            "--library",
            str(library),
            "--metrics-address",
            "127.0.0.1",
            "--metrics-port",
            str(self.daemon_metrics_port),
            "--host-lib-dir",
            str(self.vgpu),
            "--memory-hook",  # a test's own --memory-hook, after it, wins
            str(hook),
            *self.spec.daemon_args,
            *extra,
        ]
        self.daemon = Proc("daemon", self._in_namespace(argv), self.dir / "daemon.log", env=env)
        self.daemon_extra = list(extra)
        if wait:
            # each resource registers on its own and the kubelet may write the Node's status
            # between the two: wait for both, or a caller reads a status without vcuda-core
            memory, core = self.shared_resources()
            self.cluster.wait_allocatable(
                self.name, lambda a: int(a.get(memory, "0")) > 0 and int(a.get(core, "0")) > 0
            )
        return self.daemon

    def kill_daemon(self, sig: int = signal.SIGKILL) -> None:
        assert self.daemon is not None
        self.daemon.signal(sig)
        self.daemon.popen.wait(30)

    def stop_daemon(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None

    def restart_daemon(self, *extra: str, gpus: list[dict[str, Any]] | None = None) -> Proc:
        self.stop_daemon()
        return self.start_daemon(*extra, gpus=gpus)

    # ---- what the node shows
    def records(self) -> list[dict[str, Any]]:
        """Every container the kubelet asked the runtime to create, oldest first."""
        if not self.records_file.exists():
            return []
        return [json.loads(line) for line in self.records_file.read_text().splitlines() if line]

    def pod_resources(self) -> list[dict[str, Any]]:
        """The kubelet's PodResources List answer, as JSON (protobuf's field names)."""
        return self.cluster.pod_resources(self.root / "pod-resources" / "kubelet.sock")

    def allocatable_devices(self) -> dict[str, int]:
        """How many devices of each resource the kubelet's PodResources
        GetAllocatableResources lists (the healthy devices of the plugins registered with
        this kubelet, allocated or not)."""
        reply = self.cluster.pod_resources_call(
            self.root / "pod-resources" / "kubelet.sock", "allocatable"
        )
        counts: dict[str, int] = {}
        for dev in reply.get("devices", []):
            name = dev["resource_name"]
            counts[name] = counts.get(name, 0) + len(dev.get("device_ids", []))
        return counts

    def daemon_metrics(self) -> str:
        reply = requests.get(f"http://127.0.0.1:{self.daemon_metrics_port}/metrics", timeout=5)
        reply.raise_for_status()
        return reply.text

    def stop(self) -> None:
        """Every process of the node stopped, the namespace holder last (the namespace and
        its mounts end with it); all are tried even if one fails. On a real runtime, the
        node's containers and shims go after containerd, before the namespace."""
        procs = (*self.extra, self.daemon, self.kubelet, self.cri)
        holder = self.holder
        self.extra = []
        self.daemon = self.kubelet = self.cri = self.holder = None
        errors = []
        steps: list[Callable[[], object]] = [lambda p=p: p.stop(grace=10) for p in procs if p]
        if self.containerd is not None:
            steps.append(self.containerd.clean_up)
        if holder is not None:
            steps.append(lambda: holder.stop(grace=10))
        for step in steps:
            try:
                step()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]


# --------------------------------------------------------------------------- the cluster


class Cluster:
    """etcd, kube-apiserver, kube-controller-manager, kube-scheduler and N nodes (each a
    real kubelet on a CRI fake, with the real gpushare daemon), all on 127.0.0.1."""

    def __init__(
        self, nodes: list[NodeSpec], workdir: Path | None = None, install: bool = True
    ) -> None:
        """``install=False``: neither the project's RBAC and policies nor the daemons (nodes
        are started with ``daemon=False``), for tests of installing it."""
        self.dir = workdir or Path(tempfile.mkdtemp(prefix="gse2e-", dir="/tmp"))
        self.specs = nodes
        self.install = install
        self.procs: dict[str, Proc] = {}
        self.nodes: dict[str, NodeAgent] = {}
        self.admin_token = secrets.token_hex(16)
        # The API server reads its token file once: credentials for nodes added later too.
        names = [n.name for n in nodes] + [f"node-{i}" for i in range(1, SPARE_NODES + 1)]
        self.node_tokens = {name: secrets.token_hex(16) for name in names}
        self.api_port = free_port()
        self.server = f"https://127.0.0.1:{self.api_port}"
        self.ca = self.dir / "apiserver" / "apiserver.crt"
        self.api: Api = Api(self.server, self.admin_token, self.ca)
        self.extender: Proc | None = None
        self.extender_port = 0
        self._protos: Path | None = None

    # ---- start and stop
    def start(self) -> None:
        missing = [
            b
            for b in (
                "etcd",
                "kube-apiserver",
                "kube-scheduler",
                "kube-controller-manager",
                "kubelet",
                "crifake",
            )
            if not (BIN / b).exists()
        ]
        if missing:
            raise E2EError(f"missing {missing} in {BIN}: run `make e2e` (it builds them)")
        urllib3.disable_warnings()
        self._start_etcd()
        self._start_apiserver()
        self._start_controller_manager()
        self.start_scheduler()
        self.wait_service_account("default", "default")
        self.wait_service_account("kube-system", "default")
        if self.install:
            self.install_base()
        for spec in self.specs:
            self.add_node(spec, daemon=self.install)

    def stop(self, logs: Path | None = None) -> None:
        """Every process stopped (TERM, then KILL after a deadline; namespaces end with their
        last process), the logs and CRI records copied to ``logs`` if given (replacing what
        was there), and the cluster's directory removed (kept with GPUSHARE_E2E_KEEP=1)."""
        errors: list[BaseException] = []

        def attempt(stop: Callable[[], object]) -> None:
            try:
                stop()
            except Exception as exc:  # go on stopping the rest; report the first at the end
                errors.append(exc)

        for agent in self.nodes.values():
            attempt(agent.stop)
        if self.extender is not None:
            attempt(self.extender.stop)
        # Schedulers and anything else first, then the control plane from the top down.
        control_plane = ["kube-controller-manager", "kube-apiserver", "etcd"]
        order = [n for n in self.procs if n not in control_plane] + control_plane
        for name in order:
            proc = self.procs.pop(name, None)
            if proc is not None:
                attempt(lambda p=proc: p.stop(grace=15))
        if logs is not None:
            attempt(lambda: self.copy_logs(logs))
        if os.environ.get("GPUSHARE_E2E_KEEP") != "1":
            shutil.rmtree(self.dir, ignore_errors=True)
        if errors:
            raise errors[0]

    def copy_logs(self, logs: Path) -> None:
        """Each component's log and each node's CRI record into ``logs`` (replacing it)."""
        shutil.rmtree(logs, ignore_errors=True)
        for path in [*self.dir.rglob("*.log"), *self.dir.glob("*/containers.jsonl")]:
            if "kubelet" in path.relative_to(self.dir).parts[1:2]:
                continue  # the kubelet's root directory: pod logs of the fake, none useful
            target = logs / path.relative_to(self.dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self.procs["etcd"] = Proc(
            "etcd",
            controlplane.etcd_argv(BIN, self.dir / "etcd", client, peer),
            self.dir / "etcd.log",
        )
        wait_for(
            "etcd /health", lambda: self._healthy(self.procs["etcd"], f"{self.etcd_url}/health"), 60
        )

    def _alive(self, proc: Proc) -> bool:
        if not proc.alive():
            raise E2EError(f"{proc.name} exited:\n{proc.tail()}")
        return True

    def _healthy(self, proc: Proc, url: str, **kwargs: Any) -> bool:
        if not proc.alive():
            raise E2EError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            return requests.get(url, timeout=2, **kwargs).status_code == 200
        except requests.RequestException:
            return False

    def _start_apiserver(self) -> None:
        d = self.dir / "apiserver"
        d.mkdir(parents=True, exist_ok=True)
        key = self.dir / "sa.key"
        controlplane.make_key(key)
        tokens = [f'{self.admin_token},admin,admin,"system:masters"']
        for name, token in self.node_tokens.items():
            tokens.append(f'{token},system:node:{name},node-{name},"system:nodes"')
        (self.dir / "tokens.csv").write_text("\n".join(tokens) + "\n")
        argv = controlplane.apiserver_argv(
            BIN, self.etcd_url, self.api_port, d, self.dir / "tokens.csv", key, FEATURE_GATES
        )
        self.procs["kube-apiserver"] = Proc(
            "kube-apiserver",
            [
                *argv,
                "--allow-privileged",
                "--runtime-config",
                # resource.k8s.io/v1 is on by default; MutatingAdmissionPolicy is GA (v1) in
                # 1.36, its v1beta1 is off by default: on for the manifests written for it.
                "resource.k8s.io/v1=true,admissionregistration.k8s.io/v1beta1=true",
            ],
            self.dir / "kube-apiserver.log",
        )
        wait_for(
            "kube-apiserver /readyz",
            lambda: (
                self.ca.exists()
                and self._healthy(
                    self.procs["kube-apiserver"],
                    f"{self.server}/readyz",
                    headers={"Authorization": f"Bearer {self.admin_token}"},
                    verify=str(self.ca),
                )
            ),
            120,
            step=0.25,
        )
        self.write_kubeconfig(self.dir / "admin.kubeconfig", self.admin_token)
        for name, token in self.node_tokens.items():
            self.write_kubeconfig(self.node_kubeconfig(name), token)

    def write_kubeconfig(self, path: Path, token: str) -> Path:
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {
                            "name": "e2e",
                            "cluster": {
                                "server": self.server,
                                "certificate-authority": str(self.ca),
                            },
                        }
                    ],
                    "users": [{"name": "user", "user": {"token": token}}],
                    "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "user"}}],
                    "current-context": "e2e",
                }
            )
        )
        return path

    @property
    def admin_kubeconfig(self) -> Path:
        return self.dir / "admin.kubeconfig"

    def node_kubeconfig(self, name: str) -> Path:
        return self.dir / f"{name}.kubeconfig"

    def _start_controller_manager(self) -> None:
        gates = ",".join(f"{k}={str(v).lower()}" for k, v in FEATURE_GATES.items())
        self.procs["kube-controller-manager"] = Proc(
            "kube-controller-manager",
            [
                str(BIN / "kube-controller-manager"),
                "--kubeconfig",
                str(self.admin_kubeconfig),
                "--service-account-private-key-file",
                str(self.dir / "sa.key"),
                "--root-ca-file",
                str(self.ca),
                "--use-service-account-credentials=false",
                "--leader-elect=false",
                "--secure-port",
                "0",
                "--controllers",
                "*",
                "--feature-gates",
                gates,
            ],
            self.dir / "kube-controller-manager.log",
        )

    def start_scheduler(
        self, config: dict[str, Any] | None = None, name: str = "kube-scheduler"
    ) -> Proc:
        """(Re)start the kube-scheduler process ``name``: stock, or with a
        KubeSchedulerConfiguration (its client connection and leader election are set to this
        cluster's; an extender urlPrefix on 127.0.0.1:9446 is pointed at this cluster's
        extender). Several can run at once under different names (other profiles)."""
        self.stop_scheduler(name)
        gates = ",".join(f"{k}={str(v).lower()}" for k, v in FEATURE_GATES.items())
        argv = [str(BIN / "kube-scheduler"), "--secure-port", "0", "--feature-gates", gates]
        if config is None:
            argv += ["--kubeconfig", str(self.admin_kubeconfig), "--leader-elect=false"]
        else:
            config = json.loads(json.dumps(config))
            config["clientConnection"] = {"kubeconfig": str(self.admin_kubeconfig)}
            config["leaderElection"] = {"leaderElect": False}
            for ext in config.get("extenders", []):
                ext["urlPrefix"] = ext["urlPrefix"].replace(
                    "127.0.0.1:9446", f"127.0.0.1:{self.extender_port}"
                )
            path = self.dir / f"{name}-config.yaml"
            path.write_text(yaml.safe_dump(config))
            argv += ["--config", str(path)]
        proc = Proc(name, argv, self.dir / f"{name}.log")
        self.procs[name] = proc
        return proc

    def stop_scheduler(self, name: str = "kube-scheduler") -> None:
        old = self.procs.pop(name, None)
        if old is not None:
            old.stop()

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Proc:
        """Run a program beside the control plane (not on a node), its output in
        ``<workdir>/<name>.log``; stopped with the cluster (before the control plane)."""
        if name in self.procs:
            self.procs.pop(name).stop()
        proc = Proc(name, argv, self.dir / f"{name}.log", env=env)
        self.procs[name] = proc
        return proc

    def start_extender(self, *extra: str) -> Proc:
        """``gpushare-scheduler-extender`` on a free loopback port with the token of its own
        ServiceAccount (daemonset/extender/extender.yaml's RBAC, applied here)."""
        if self.extender is not None:
            self.extender.stop()
        self.api.apply_all(
            o
            for o in load_manifests(REPO / "daemonset/extender/extender.yaml")
            if o["kind"]
            in ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
        )
        token = self.token_for_account("kube-system", "gpushare-scheduler-extender")
        token_file = self.dir / "extender.token"
        token_file.write_text(token)
        self.extender_port = free_port()
        probe = free_port()
        self.extender = Proc(
            "extender",
            [
                str(SCRIPTS / "gpushare-scheduler-extender"),
                "--address",
                "127.0.0.1",
                "--port",
                str(self.extender_port),
                "--url-prefix",
                "/gpushare",
                "--api-server",
                self.server,
                "--token-file",
                str(token_file),
                "--ca-file",
                str(self.ca),
                "--probe-address",
                "127.0.0.1",
                "--probe-port",
                str(probe),
                "--log-format",
                "json",
                *extra,
            ],
            self.dir / "extender.log",
        )
        ext = self.extender
        wait_for(
            "the extender's /readyz",
            lambda: self._healthy(ext, f"http://127.0.0.1:{probe}/readyz"),
            30,
        )
        return ext

    def install_base(self) -> None:
        """The project's RBAC (the daemon's ServiceAccount and roles) and admission policies,
        through the API server, and a wait until the policies are in force."""
        self.api.apply_all(load_manifests(REPO / "daemonset" / "rbac.yaml"))
        policies = sorted((REPO / "daemonset" / "policies").glob("*.yaml"))
        self.api.apply_all(load_manifests(*policies))
        self.wait_policies_in_force()

    def wait_policies_in_force(self) -> None:
        """Policies work once the API server's policy plugin has them; nothing reports that
        (it reads its informers' objects and recompiles about once a second). A sentinel
        policy of the harness, applied after the project's, refuses pods labelled
        ``e2e.gpushare.io/sentinel``: once it refuses one, the policies and bindings written
        before it are loaded too (policies and bindings each come through one informer,
        events in order). Each call writes the sentinel anew, its policy's message and its
        binding's selector naming a fresh nonce, and waits for a refusal carrying that nonce:
        a sentinel left as it was by an earlier call would prove nothing about a binding put
        back since (test_pod_env's policy_off). The project's own policies are not used as
        the probe, so that a broken policy fails its tests, not the cluster's start."""
        sentinel = "e2e-sentinel"
        nonce = secrets.token_hex(4)
        label = "e2e.gpushare.io/sentinel"
        self.api.apply_all(
            [
                {
                    "apiVersion": "admissionregistration.k8s.io/v1",
                    "kind": "ValidatingAdmissionPolicy",
                    "metadata": {"name": sentinel},
                    "spec": {
                        "failurePolicy": "Fail",
                        "matchConstraints": {
                            "resourceRules": [
                                {
                                    "apiGroups": [""],
                                    "apiVersions": ["v1"],
                                    "operations": ["CREATE"],
                                    "resources": ["pods"],
                                }
                            ]
                        },
                        "validations": [
                            {
                                "expression": "!has(object.metadata.labels) || "
                                f"!('{label}' in object.metadata.labels)",
                                "message": f"e2e sentinel {nonce}",
                            }
                        ],
                    },
                },
                {
                    "apiVersion": "admissionregistration.k8s.io/v1",
                    "kind": "ValidatingAdmissionPolicyBinding",
                    "metadata": {"name": sentinel},
                    "spec": {
                        "policyName": sentinel,
                        "validationActions": ["Deny"],
                        "matchResources": {"objectSelector": {"matchLabels": {label: nonce}}},
                    },
                },
            ]
        )
        probe_pod = pod_manifest("policy-probe", {})
        probe_pod["metadata"]["labels"] = {label: nonce}

        def refused() -> bool:
            reply = self.api.create(probe_pod, dry_run=True)
            return reply.status_code in (403, 422) and f"e2e sentinel {nonce}" in reply.text

        wait_for("the admission policies to be in force", refused, 60, step=0.25)

    def add_node(self, spec: NodeSpec, daemon: bool = True) -> NodeAgent:
        """Start a node (namespace, CRI fake, kubelet) and wait until it is Ready; with
        ``daemon``, also its DaemonSet-template pod and the gpushare daemon."""
        agent = NodeAgent(self, spec, free_port(), free_port())
        self.nodes[spec.name] = agent
        agent._start_namespace()
        agent._start_cri()
        agent.start_kubelet()
        self.wait_node_ready(spec.name)
        if spec.pod_network:
            self.give_node_address(spec.name)
        if not daemon:
            return agent
        reply = self.api.create(agent.daemon_pod_manifest())
        if reply.status_code not in (201, 409):
            raise E2EError(f"daemon pod for {spec.name}: {reply.status_code} {reply.text[:400]}")
        self.wait_pod("kube-system", agent.daemon_pod, "Running")
        agent.start_daemon()
        return agent

    def remove_node(self, name: str) -> None:
        """Stop the node's daemon, kubelet and namespace; delete its Node object (its pods
        go with it: the daemon pod is deleted first)."""
        agent = self.nodes.pop(name)
        agent.stop()
        self.api.delete(
            f"/api/v1/namespaces/kube-system/pods/{agent.daemon_pod}", gracePeriodSeconds=0
        )
        self.api.delete(f"/api/v1/nodes/{name}")
        # A node added later under this name starts on a directory of its own, as a new
        # machine would (no kubelet checkpoints, plugin sockets, CRI records or markers of
        # this one); this one's logs are kept beside it for copy_logs.
        if agent.dir.exists():
            n = 1
            while (aside := agent.dir.with_name(f"{name}.removed-{n}")).exists():
                n += 1
            agent.dir.rename(aside)

    # ---- waits
    def wait_service_account(self, ns: str, name: str) -> None:
        wait_for(
            f"ServiceAccount {ns}/{name}",
            lambda: self.api.get_or_none(f"/api/v1/namespaces/{ns}/serviceaccounts/{name}"),
            90,
            step=0.25,
        )

    def node(self, name: str) -> dict[str, Any]:
        return self.api.get(f"/api/v1/nodes/{name}")

    def wait_node_ready(self, name: str, timeout: float = 90) -> dict[str, Any]:
        def ready() -> dict[str, Any] | None:
            node = self.api.get_or_none(f"/api/v1/nodes/{name}")
            if node is None:
                return None
            conditions = node.get("status", {}).get("conditions", [])
            ok = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
            return node if ok else None

        return wait_for(f"node {name} Ready", ready, timeout, step=0.25)

    def give_node_address(self, name: str) -> None:
        """Set the Node's address to 127.0.0.1 (InternalIP), as a cloud controller sets a
        node's addresses: the API server then reaches the node's kubelet there (its port is
        the Node's daemonEndpoints') for a pod's log, exec or port-forward. The kubelet sets
        none itself here: it refuses a loopback --node-ip ("failed to validate nodeIP: nodeIP
        can't be loopback address", each status update) and so leaves the addresses as they
        are, and this machine offers no other address that is only the node's."""
        body = {"status": {"addresses": [{"type": "InternalIP", "address": "127.0.0.1"}]}}
        reply = self.api.patch(f"/api/v1/nodes/{name}/status", body)
        if reply.status_code != 200:
            raise E2EError(f"node {name}'s address: {reply.status_code} {reply.text[:400]}")

    def allocatable(self, name: str) -> dict[str, str]:
        return dict(self.node(name).get("status", {}).get("allocatable", {}))

    def wait_allocatable(
        self, name: str, predicate: Callable[[dict[str, str]], bool], timeout: float = 60
    ) -> dict[str, str]:
        def probe() -> dict[str, str] | None:
            alloc = self.allocatable(name)
            return alloc if predicate(alloc) else None

        return wait_for(f"node {name}'s allocatable to change", probe, timeout, step=0.25)

    def pod(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.api.get_or_none(f"/api/v1/namespaces/{ns}/pods/{name}")

    def create_pod(self, manifest: dict[str, Any]) -> dict[str, Any]:
        reply = self.api.create(manifest)
        if reply.status_code != 201:
            raise E2EError(
                f"create pod {manifest['metadata']['name']}: {reply.status_code} {reply.text[:600]}"
            )
        return dict(reply.json())

    def wait_pod(self, ns: str, name: str, *phases: str, timeout: float = 90) -> dict[str, Any]:
        """Until the pod's phase is one of ``phases`` (fails at once on an unexpected end)."""

        def probe() -> dict[str, Any] | None:
            pod = self.pod(ns, name)
            if pod is None:
                return None
            phase = pod.get("status", {}).get("phase")
            if phase in phases:
                return pod
            if phase in ("Failed", "Succeeded"):
                raise E2EError(f"pod {ns}/{name} ended {phase}: {pod.get('status')}")
            return None

        return wait_for(f"pod {ns}/{name} to be {'/'.join(phases)}", probe, timeout, step=0.2)

    def wait_scheduling_refused(self, ns: str, name: str, timeout: float = 60) -> dict[str, Any]:
        """Until the scheduler said it cannot place the pod (PodScheduled False, Unschedulable)."""

        def probe() -> dict[str, Any] | None:
            pod = self.pod(ns, name)
            for c in (pod or {}).get("status", {}).get("conditions", []):
                if c["type"] == "PodScheduled" and c["status"] == "False":
                    return c
            return None

        return wait_for(f"the scheduler to refuse {ns}/{name}", probe, timeout, step=0.2)

    def delete_pod(self, ns: str, name: str, wait: bool = True) -> None:
        """Delete and, unless told not, wait until the object is gone. A grace period of 1 s,
        not 0: with 0 the API server removes a bound pod at once, before its kubelet has
        stopped it; with 1 the object goes when the kubelet has stopped the containers (the
        fake stops them at once) and released their devices."""
        self.api.delete(f"/api/v1/namespaces/{ns}/pods/{name}", gracePeriodSeconds=1)
        if wait:
            wait_for(
                f"pod {ns}/{name} to be gone", lambda: self.pod(ns, name) is None, 90, step=0.2
            )

    def records(self, node: str, ns: str, pod: str) -> dict[str, dict[str, Any]]:
        """The latest record of each container of the pod on ``node`` (by container name)."""
        out: dict[str, dict[str, Any]] = {}
        for rec in self.nodes[node].records():
            if rec["namespace"] == ns and rec["pod"] == pod:
                out[rec["container"]] = rec
        return out

    def wait_record(self, node: str, ns: str, pod: str, container: str) -> dict[str, Any]:
        return wait_for(
            f"the CRI record of {ns}/{pod}/{container} on {node}",
            lambda: self.records(node, ns, pod).get(container),
            60,
            step=0.2,
        )

    # ---- containers on a real runtime, read from inside
    def image_tar(self) -> Path:
        """The e2e image as a docker-archive tar (tests/e2e/local_image.py), made once per
        cluster; every containerd node imports it."""
        tar = self.dir / "e2e-image.tar"
        if not tar.exists():
            make_image(tar)
        return tar

    def pod_log(self, ns: str, pod: str, container: str) -> str:
        """The container's log as the kubelet serves it (``/containerLogs``, the endpoint the
        API server proxies `kubectl logs` to; the kubelet reads the file containerd wrote).
        Asked of the node's kubelet directly: the API server cannot proxy here, the kubelet
        sets no node address ("failed to validate nodeIP: nodeIP can't be loopback address"),
        so the API server answers 500 "no preferred addresses found". Its port is the node's
        own (anonymous, loopback only)."""
        node = (self.pod(ns, pod) or {}).get("spec", {}).get("nodeName")
        if node not in self.nodes:
            raise ValueError(f"pod {ns}/{pod} is on no node of this cluster ({node})")
        port = self.nodes[node].kubelet_port
        with warnings.catch_warnings():  # the kubelet's self-signed certificate, on loopback
            warnings.simplefilter("ignore", urllib3.exceptions.InsecureRequestWarning)
            reply = requests.get(
                f"https://127.0.0.1:{port}/containerLogs/{ns}/{pod}/{container}",
                verify=False,
                timeout=10,
            )
        reply.raise_for_status()
        return reply.text

    def wait_report(
        self, ns: str, pod: str, container: str, timeout: float = 90
    ) -> dict[str, list[str]]:
        """The report of a container running the e2e image's ``/report`` (its sections:
        local_image.report_sections), once complete in its log."""
        return wait_for(
            f"the report of {ns}/{pod}/{container}",
            lambda: report_sections(self.pod_log(ns, pod, container)),
            timeout,
            step=0.25,
        )

    # ---- tokens
    def token_for_pod(self, ns: str, account: str, pod: str) -> str:
        """A bound ServiceAccount token for ``account``, bound to ``pod`` (TokenRequest): what
        the kubelet mounts into the pod; it carries the pod's node name."""
        obj = self.api.get(f"/api/v1/namespaces/{ns}/pods/{pod}")
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": 7200,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod,
                    "uid": obj["metadata"]["uid"],
                },
            },
        }
        return self._token(ns, account, body)

    def token_for_account(self, ns: str, account: str) -> str:
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {"expirationSeconds": 7200},
        }
        return self._token(ns, account, body)

    def _token(self, ns: str, account: str, body: dict[str, Any]) -> str:
        reply = self.api.post(f"/api/v1/namespaces/{ns}/serviceaccounts/{account}/token", body)
        if reply.status_code != 201:
            raise E2EError(f"TokenRequest for {ns}/{account}: {reply.status_code} {reply.text}")
        return str(reply.json()["status"]["token"])

    # ---- PodResources, read in a separate interpreter (no gpushare module loaded there)
    def pod_resources(self, socket_path: Path) -> list[dict[str, Any]]:
        return list(self.pod_resources_call(socket_path, "list").get("pod_resources", []))

    def pod_resources_call(self, socket_path: Path, call: str) -> dict[str, Any]:
        """The kubelet's PodResources ``list`` or ``allocatable`` answer, as JSON."""
        if self._protos is None:
            out = self.dir / "protos"
            out.mkdir(exist_ok=True)
            proto = find_proto("podresources/v1/api.proto")
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "grpc_tools.protoc",
                    f"-I{proto.parents[2]}",
                    f"--python_out={out}",
                    f"--grpc_python_out={out}",
                    str(proto),
                ],
                check=True,
                capture_output=True,
            )
            self._protos = out
        reply = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).parent / "podresources_list.py"),
                str(self._protos),
                str(socket_path),
                call,
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return dict(json.loads(reply.stdout))

    # ---- kubectl, as a user would run it
    def kubectl(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``kubectl`` built by e2e/build.sh from the same Kubernetes modules as the cluster
        (``<bin>/kubectl``), with the admin's kubeconfig; never raises on its exit code."""
        if not (BIN / "kubectl").exists():
            raise E2EError(f"missing kubectl in {BIN}: run `make e2e-build`")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
        env["KUBECONFIG"] = str(self.admin_kubeconfig)
        return subprocess.run(
            [str(BIN / "kubectl"), *args],
            env=env,
            cwd=self.dir,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    # ---- kubectl gpushare, as a user would run it
    def kubectl_gpushare(
        self, *args: str, token: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = dict(os.environ)
        env.pop("KUBERNETES_SERVICE_HOST", None)
        config = self.admin_kubeconfig
        if token is not None:
            config = self.write_kubeconfig(self.dir / "user.kubeconfig", token)
        env["KUBECONFIG"] = str(config)
        env["PYTHONPATH"] = CHECKOUT_SRC
        return subprocess.run(
            [str(SCRIPTS / "kubectl-gpushare"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )


def pod_manifest(
    name: str,
    limits: dict[str, int] | None = None,
    *,
    containers: dict[str, dict[str, int]] | None = None,
    namespace: str = "default",
    node: str | None = None,
    scheduler: str | None = None,
    report: bool = False,
) -> dict[str, Any]:
    """A pod of pause containers: one container ``main`` asking ``limits``, or one per entry
    of ``containers`` (name -> limits). ``node`` is a nodeSelector on the hostname label.
    ``report``: for a node on a real runtime, the containers run the e2e image's ``/report``
    (never pulled) on the host network (local_image.py)."""
    if containers is None:
        containers = {"main": limits or {}}
    spec: dict[str, Any] = {
        "containers": [
            {
                "name": cname,
                "image": "registry.k8s.io/pause:3.10",
                "resources": {"limits": {k: str(v) for k, v in lim.items()}} if lim else {},
            }
            for cname, lim in containers.items()
        ],
        "automountServiceAccountToken": False,
        "terminationGracePeriodSeconds": 1,
        "tolerations": [{"operator": "Exists"}],
    }
    if report:
        for c in spec["containers"]:
            c.update(image=IMAGE, imagePullPolicy="Never", command=["/bin/sh", "/report"])
        spec["hostNetwork"] = True
    if node is not None:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    if scheduler is not None:
        spec["schedulerName"] = scheduler
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


@contextlib.contextmanager
def running_cluster(
    nodes: list[NodeSpec], logs: Path | None = None, install: bool = True
) -> Iterator[Cluster]:
    """A started cluster, stopped (and its logs copied to ``logs``) however the block ends."""
    cluster = Cluster(nodes, install=install)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop(logs)
