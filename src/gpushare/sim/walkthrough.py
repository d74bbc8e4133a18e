"""The operator's walk-through of docs/operations.md, run for real on a simulated node.

``python -m gpushare.sim.walkthrough --write docs/operations.md`` starts the API-server
double (one GPU node, one CPU node), runs ``kubectl gpushare install``, starts the real
daemon on a simulated node of two Tesla P4 as the DaemonSet would (``NODE_NAME``, the
API link to the double, the kubelet stand-in), admits workloads, and runs ``inspect``,
``verify``, a metrics scrape, an upgrade and ``uninstall``, recording each command and
what it printed. The section ``walkthrough`` of the file is rewritten with that record;
tests/test_operations_doc.py runs it again and compares (times, generations and random
names aside), so the page never drifts from what the commands print.

``verify`` runs its probe where the pod would run: a stand-in for the node admits the
probe pod through the kubelet stand-in (so the daemon allocates its units) and runs
``python -m gpushare.probe`` with the environment the daemon's answer gave,
without a GPU here: what is printed is what verify says on a node without a driver.
``uninstall``'s host cleanup pod runs the same way: ``python -m gpushare.node.hostsweep``
with the pod's own arguments and the simulated node's paths (never this machine's).
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import structlog
import yaml

from gpushare.base.cli import Parser
from gpushare.config import Settings
from gpushare.daemon import Daemon
from gpushare.host.elf import stand_in
from gpushare.ops import kubectl
from gpushare.ops.mdsection import replace_section
from gpushare.sim.apidouble import KubeApiDouble
from gpushare.sim.kubeletdouble import SimulatedKubelet
from gpushare.sim.podstatus import ended_status

NODE = "gpu-node-1"
IMAGE = "registry.example.com/gpushare:0.1.0"
UPGRADE = "registry.example.com/gpushare:0.1.1"
SECTION = "walkthrough"
P4 = {"name": "Tesla P4", "memory_mib": 7611}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Transcript:
    def __init__(self) -> None:
        self.parts: list[str] = []

    def text(self, text: str) -> None:
        self.parts.append(text.strip() + "\n")

    def command(self, line: str, output: str) -> None:
        self.parts.append(f"```console\n$ {line}\n{output.rstrip()}\n```\n")

    def render(self) -> str:
        return "\n".join(self.parts)


def _kubectl(args: list[str]) -> tuple[int, str]:
    """The command as a script runs it: its stdin is no terminal (nothing is asked)."""
    out = io.StringIO()
    stdin, sys.stdin = sys.stdin, io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = kubectl.main(args)
    finally:
        sys.stdin = stdin
    return code, out.getvalue()


class _PodRunner:
    """Runs each new pod of the double whose name starts with :attr:`prefix` once
    (:meth:`_finish`), on a thread, while in its ``with`` block: a node's kubelet, for
    the short-lived pods of a command."""

    prefix = ""

    def __init__(self, api: KubeApiDouble) -> None:
        self.api = api
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _PodRunner:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        done: set[str] = set()
        while not self._stop.wait(0.05):
            for key, pod in list(self.api.objects.items()):
                if f"/pods/{self.prefix}" not in key or key in done:
                    continue
                done.add(key)
                self._finish(key, pod)

    def _finish(self, key: str, pod: dict[str, Any]) -> None:
        raise NotImplementedError


class ProbeNode(_PodRunner):
    """Stands in for the node under ``kubectl gpushare verify``: admits the probe pod
    through the kubelet stand-in and runs the probe with the daemon's environment."""

    prefix = "gpushare-verify-"

    def __init__(self, api: KubeApiDouble, kubelet: SimulatedKubelet) -> None:
        super().__init__(api)
        self.kubelet = kubelet

    def _finish(self, key: str, pod: dict[str, Any]) -> None:
        (container,) = pod["spec"]["containers"]
        limits = {k: int(v) for k, v in container["resources"]["limits"].items()}
        admitted = self.kubelet.admit(pod["metadata"]["name"], container["name"], limits)
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "PYTHONPATH", "HOME")}
        # The container's environment, but the preload: the library is a stand-in here
        # and the host's loader would only complain about a path of the container.
        env.update({k: v for k, v in admitted.envs.items() if k != "LD_PRELOAD"})
        result = subprocess.run(
            [sys.executable, "-m", "gpushare.probe"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        self.api.logs[key] = result.stdout + result.stderr
        with self.api._lock:
            # The stored object, not the one read before the probe ran: the daemon's pod
            # annotation may have replaced it meanwhile (a slow probe on a busy machine).
            current = self.api.objects.get(key)
            if current is not None:
                current.setdefault("status", {}).update(
                    ended_status(container["name"], result.returncode)
                )
                self.api._put(key, current)
        self.kubelet.release(pod["metadata"]["name"])  # the pod has ended


class CleanupNode(_PodRunner):
    """Stands in for the node under ``uninstall``'s host cleanup pod: runs the cleanup
    program with the pod's arguments on the simulated node's directories (``settings``'
    paths: the DRA and CDI ones under ``root``) and ends the pod with its report as the
    termination message, as the kubelet would."""

    prefix = "gpushare-host-cleanup-"

    def __init__(self, api: KubeApiDouble, settings: Settings, root: Path) -> None:
        super().__init__(api)
        self.settings, self.root = settings, root

    def _finish(self, key: str, pod: dict[str, Any]) -> None:
        (container,) = pod["spec"]["containers"]
        claims = [a for a in container["args"] if a.startswith(("--held-claims", "--claims-"))]
        settings, root = self.settings, self.root
        report = root / f"termination-log-{len(key)}"
        argv = [*claims, f"--report={report}", f"--host-lib-parent={root}", "--",
                f"--host-lib-dir={settings.host_lib_dir}",
                f"--kubelet-dir={settings.kubelet_dir}",
                f"--pod-resources-socket={settings.pod_resources_socket}",
                f"--dra-kubelet-root={root / 'kubelet'}",
                f"--dra-cdi-dir={root / 'cdi'}"]  # fmt: skip
        result = subprocess.run(
            [sys.executable, "-m", "gpushare.node.hostsweep", *argv],
            capture_output=True,
            text=True,
            timeout=120,
        )
        message = report.read_text() if report.exists() else result.stderr[-1000:]
        terminated = {"exitCode": result.returncode, "message": message}
        with self.api._lock:
            current = self.api.objects.get(key)
            if current is not None:
                current["status"] = {
                    "phase": "Succeeded" if result.returncode == 0 else "Failed",
                    "containerStatuses": [{"name": "cleanup", "state": {"terminated": terminated}}],
                }
                self.api._put(key, current)


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    sink = open(os.devnull, "w")  # noqa: SIM115 - closed below
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(file=sink))
    try:
        yield
    finally:
        structlog.reset_defaults()
        sink.close()


def _metrics_lines(daemon: Daemon, names: tuple[str, ...]) -> str:
    assert daemon.metrics is not None
    text = daemon.metrics.render().decode()
    return "\n".join(line for line in text.splitlines() if line.startswith(names))


def run(root: Path) -> str:
    """The walk-through's markdown (commands and their outputs)."""
    api = KubeApiDouble()
    api.start()
    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    os.environ["KUBECONFIG"] = str(api.kubeconfig(root / "kubeconfig"))
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    walk = _Walk(api, root)
    try:
        walk.install()
        walk.verify()
        walk.watch()
        walk.upgrade()
        walk.remove()
    finally:
        walk.close()
        api.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return walk.t.render()


class _Walk:
    """The walk-through's steps, each a section of the page: the cluster (the API-server
    double with a GPU node and a CPU node), then the daemon on a simulated node of two
    Tesla P4 under a simulated kubelet."""

    def __init__(self, api: KubeApiDouble, root: Path) -> None:
        self.t = Transcript()
        self.api = api
        self.root = root
        self.daemon: Daemon | None = None
        self.kubelet: SimulatedKubelet | None = None
        self.settings: Settings | None = None

    def install(self) -> None:
        t = self.t
        for name, labels in ((NODE, {"nvidia.com/gpu.present": "true"}), ("cpu-node-1", {})):
            self.api.add({"apiVersion": "v1", "kind": "Node",
                          "metadata": {"name": name, "labels": labels}})  # fmt: skip
        t.text("### 1. Install\n\nApply the manifests and opt the GPU node in:")
        t.command(
            f"kubectl gpushare install --node {NODE} --image {IMAGE}",
            _kubectl(["install", "--node", NODE, "--image", IMAGE])[1],
        )
        t.text(
            "The DaemonSet now runs the daemon on the node. It registers its resources with "
            "the kubelet and publishes the node's cards; `inspect` shows them (here: a node "
            "of two Tesla P4, and two workloads admitted, one of 20 units and 30 cores, one "
            "of 4 units):"
        )
        daemon, kubelet = self._start_node()
        settings = daemon.settings
        for pod, requests in (("train", {"vcuda-memory": 20, "vcuda-core": 30}),
                              ("notebook", {"vcuda-memory": 4})):  # fmt: skip
            limits = {f"{settings.resource_prefix}/{k}": v for k, v in requests.items()}
            self.api.add(_pod(pod, limits))
            kubelet.admit(pod, "main", limits)
        assert daemon.core is not None
        link = daemon.core.api_link
        assert link is not None
        _wait(lambda: link.annotator.handled >= 3)  # train: two resources, notebook: one
        link.published.clear()
        link.notify_changed()
        _wait(link.published.is_set)
        t.command("kubectl gpushare inspect -d", _kubectl(["inspect", "-d"])[1])

    def _start_node(self) -> tuple[Daemon, SimulatedKubelet]:
        """The simulated GPU node: its kubelet, then the daemon, registered."""
        root = self.root
        gpus = [
            {"uuid": f"GPU-0000000{i}-0000-4000-8000-00000000000{i}", **P4, "numa_node": 0}
            for i in range(2)
        ]
        (root / "node.yaml").write_text(yaml.safe_dump({"gpus": gpus}))
        (root / "libvgpu.so").write_bytes(stand_in(b"walkthrough interposer stand-in\n"))
        settings = Settings(
            kubelet_dir=str(root / "dp"),
            pod_resources_socket=str(root / "pr" / "kubelet.sock"),
            simulate=str(root / "node.yaml"),
            library=str(root / "libvgpu.so"),
            host_lib_dir=str(root / "vgpu"),
            metrics_port=_free_port(),
            metrics_address="127.0.0.1",
            node_name=NODE,
        )
        kubelet = SimulatedKubelet(Path(settings.kubelet_dir), Path(settings.pod_resources_socket))
        self.kubelet, self.settings = kubelet, settings
        kubelet.start()
        daemon = Daemon(settings)
        self.daemon = daemon
        daemon.start()
        _wait(lambda: bool(kubelet.devices(settings.memory_resource)))
        return daemon, kubelet

    def verify(self) -> None:
        self.t.text(
            "### 2. Verify on your node\n\n"
            "`verify` runs a short-lived pod on the node asking for 4 memory units and 30 core "
            "units, with the image's enforcement probe, and prints the probe's verdict "
            "(exit 0: every limit holds; 1: one does not, named; 3: no report). On this page "
            "the node is simulated and has no GPU, so the probe says it cannot run (exit 3); "
            "on a GPU node its report follows (see below):"
        )
        assert self.kubelet is not None and self.daemon is not None
        with ProbeNode(self.api, self.kubelet):
            code, out = _kubectl(["verify", "--node", NODE])
        self.t.command(f"kubectl gpushare verify --node {NODE}", out + f"(exit {code})")
        core = self.daemon.core
        assert core is not None
        core.refresher.refresh_once()  # the probe pod has ended: the kubelet's records now

    def watch(self) -> None:
        assert self.daemon is not None
        self.t.text("### 3. Watch\n\nPer card and per container, from the daemon's `/metrics`:")
        self.t.command(
            "curl -s http://<pod IP>:9445/metrics | grep -E "
            "'^gpushare_(memory_allocated_bytes|container_memory_bytes|gpu_healthy)'",
            _metrics_lines(self.daemon, ("gpushare_memory_allocated_bytes",
                                         "gpushare_container_memory_bytes",
                                         "gpushare_gpu_healthy")),
        )  # fmt: skip

    def upgrade(self) -> None:
        self.t.text(
            "### 4. Upgrade\n\nBuild and push the new image, then install again with it: the "
            "DaemonSet rolls one node at a time; running containers keep their limits."
        )
        self.t.command(
            f"kubectl gpushare install --node {NODE} --image {UPGRADE}",
            _kubectl(["install", "--node", NODE, "--image", UPGRADE])[1],
        )
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None

    def remove(self) -> None:
        t = self.t
        t.text(
            "### 5. Remove\n\nUnlabel the nodes; with none left, everything `install` created "
            "is deleted (objects it did not create are never touched). `uninstall` first lists "
            "what it will remove; on a terminal it then asks, and `--dry-run` stops there:"
        )
        t.command("kubectl gpushare uninstall --dry-run", _kubectl(["uninstall", "--dry-run"])[1])
        t.text(
            "In a script (no terminal to ask on) name the nodes with `--node`, or say `--all`. "
            "`--wait` is how long to wait for the daemon pod to leave a node before removing "
            "what it published there:"
        )
        t.text(
            "Once a node's daemon has gone, `uninstall` cleans its host with a one-shot "
            'privileged pod (docs/deploy.md, "The host cleanup pod"): what no running GPU '
            "container holds is removed, the tmpfs mounts unmounted; what one holds is kept "
            "and listed, and running `uninstall` again after it ends finishes the job. Here "
            "the workloads have ended:"
        )
        assert self.kubelet is not None and self.settings is not None
        for pod in ("train", "notebook"):
            self.kubelet.release(pod)
        with CleanupNode(self.api, self.settings, self.root):
            out = _kubectl(["uninstall", "--all", "--wait", "0"])[1]
        t.command("kubectl gpushare uninstall --all --wait 0", out)

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
        if self.kubelet is not None:
            self.kubelet.stop()


def _pod(name: str, limits: dict[str, int]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"},
        "spec": {
            "nodeName": NODE,
            "containers": [
                {"name": "main", "resources": {"limits": {k: str(v) for k, v in limits.items()}}}
            ],
        },
        "status": {"phase": "Running"},
    }


def _wait(check: Callable[[], bool], timeout: float = 20.0) -> None:
    done = threading.Event()
    deadline = threading.Timer(timeout, done.set)
    deadline.start()
    try:
        while not check():
            if done.wait(0.05):
                raise TimeoutError(f"not true within {timeout} s: {check}")
    finally:
        deadline.cancel()


def generate() -> str:
    root = Path(tempfile.mkdtemp(prefix="gs-walk-", dir="/tmp"))
    try:
        with _quiet_logs():
            return run(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m gpushare.sim.walkthrough", description=__doc__)
    parser.add_argument("--write", metavar="FILE", type=Path, help="rewrite FILE's section")
    args = parser.parse_args(argv)
    text = generate()
    if args.write:
        replace_section(args.write, SECTION, text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["generate"]
