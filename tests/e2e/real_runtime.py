"""A node's real container runtime: containerd (CRI, CDI on) running runc, both built from
their Go modules by e2e/build.sh into ``e2e/bin-runtime`` (e2e/README.md, "A real container
runtime").

Each node's containerd runs in that node's mount namespace (it must see the node's
/var/lib/kubelet: the pods' volumes and the daemon's host paths), with everything of its own
under the node's directory: ``containerd/{root,state,opt}``, its socket ``containerd.sock``,
runc's state ``runc/``, the shims' sockets ``s/`` (a short path: unix sockets), its CNI
config ``cni/``. Nothing is pulled: the one image
(tests/e2e/local_image.py) is imported from a tar with ``ctr`` and pinned as the sandbox
image. The e2e's own pods run on the host network (no CNI plugin runs for them). The
node's namespace also has a tmpfs on /var/log, so the pods' logs
(``/var/log/pods``, written by containerd, read by the kubelet) stay in the node.

The pod network (``NodeSpec.pod_network``, e2e/README.md "The pod network"): without it the
CNI config is one ``loopback`` plugin and no plugin binary, enough for containerd to report
its network ready for host-network pods, and a pod off the host network never gets a
sandbox. With it, the real CNI plugins e2e/build-runtime.sh builds (``e2e/bin-runtime/cni``):
each pod's ``eth0`` is a ``tap`` device made inside the pod's own network namespace (this
VM's kernel has no ``dummy`` links: "operation not supported"), its address from
``host-local`` in the node's own /24 (:func:`pod_subnet`, state in the node's
``cni-ipam/``), and ``lo`` up (containerd runs ``loopback`` itself). Nothing is added to
the machine's network namespace (no bridge, veth, route or iptables rule): a pod reaches
nothing and nothing reaches it, which is all a pod that only runs and logs needs (a
readiness probe on a pod IP would fail). The namespaces' mount points are under
containerd's state directory (``netns_mounts_under_state_dir``), not the host's
/var/run/netns; each ends with its pod, or with the node's mount namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from local_image import IMAGE

if TYPE_CHECKING:
    from kube_cluster import NodeAgent, Proc

REPO = Path(__file__).resolve().parents[2]
#: containerd, containerd-shim-runc-v2, ctr and runc (e2e/build-runtime.sh)
RUNTIME_BIN = Path(os.environ.get("GPUSHARE_E2E_RUNTIME_BIN") or REPO / "e2e" / "bin-runtime")
RUNTIME_PROGRAMS = ("containerd", "containerd-shim-runc-v2", "ctr", "runc")
#: the pod network's CNI plugins (e2e/build-runtime.sh, from e2e/cni/go.mod)
CNI_BIN = RUNTIME_BIN / "cni"
CNI_PLUGINS = ("tap", "host-local", "loopback")
#: containerd's plugins a node does not use, several of which would touch host paths
#: (NRI's socket in /var/run/nri) or need kernel features (btrfs, zfs, devmapper, erofs)
DISABLED_PLUGINS = [
    "io.containerd.nri.v1.nri",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.zfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.blockfile",
    "io.containerd.snapshotter.v1.erofs",
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.tracing.processor.v1.otlp",
    "io.containerd.internal.v1.tracing",
]
#: File systems overlayfs cannot stack on (its upper and work directories there fail)
NO_OVERLAY_UPPER = {"overlayfs", "overlay", "aufs", "nfs", "fuseblk", "fuse"}


def snapshotter_for(path: Path) -> str:
    """``overlayfs`` where the node's directory is on a file system overlayfs can use as its
    upper layer (ext4, xfs, btrfs, tmpfs), else ``native`` (plain copies: works anywhere,
    overlay included, but copies the whole tree for every layer and every container: the
    374 MB gpushare image takes minutes per copy on 2 busy cores)."""
    fs = subprocess.run(
        ["stat", "-f", "-c", "%T", str(path)], capture_output=True, text=True, check=False
    ).stdout.strip()
    return "native" if not fs or fs in NO_OVERLAY_UPPER else "overlayfs"


def pod_subnet(kubelet_port: int) -> str:
    """A node's pod range: the /24 of 10.0.0.0/8 its kubelet's port names. One kubelet on this
    machine holds a port at a time, so no two running nodes, of any cluster of any checkout,
    share a range (the tap devices are each in a pod's own namespace and would not
    collide anyway: distinct ranges keep the pods' IPs telling)."""
    if not 0 < kubelet_port < 1 << 16:
        raise ValueError(f"not a port: {kubelet_port}")
    return f"10.{kubelet_port >> 8}.{kubelet_port & 0xFF}.0/24"


def cni_config(node_dir: Path, kubelet_port: int, pod_network: bool) -> dict[str, object]:
    """The node's CNI network list (module docstring): ``loopback`` alone (no binary: host
    network only), or a ``tap`` eth0 with a ``host-local`` address in :func:`pod_subnet`."""
    if not pod_network:
        return {"cniVersion": "1.0.0", "name": "gpushare-e2e", "plugins": [{"type": "loopback"}]}
    ipam = {
        "type": "host-local",
        "ranges": [[{"subnet": pod_subnet(kubelet_port)}]],
        "dataDir": str(node_dir / "cni-ipam"),
    }
    return {
        "cniVersion": "1.0.0",
        "name": "gpushare-e2e-pods",
        "plugins": [{"type": "tap", "ipam": ipam}],
    }


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


class Containerd:
    """One node's containerd: config, start, image import, and a stop that leaves no
    container, shim or mount behind."""

    def __init__(self, node: NodeAgent) -> None:
        self.node = node
        self.dir = node.dir / "containerd"
        self.socket = node.dir / "containerd.sock"
        self.runc_root = node.dir / "runc"
        self.socket_dir = node.dir / "s"
        self.cni_dir = node.dir / "cni"
        self.config = node.dir / "containerd.toml"
        self.proc: Proc | None = None
        self.snapshotter = "native"

    def write_config(self) -> Path:
        """containerd's config (version 4, containerd 2.4's). What matters to gpushare: CDI
        (always on in 2.x) with the node's spec directory, runc as the runtime, the sandbox
        image pinned."""
        own = ("root", "state", "opt", "tmp")
        for d in (*(self.dir / o for o in own), self.runc_root, self.socket_dir, self.cni_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.snapshotter = snapshotter_for(self.dir)
        pod_network = self.node.spec.pod_network
        network = cni_config(self.node.dir, self.node.kubelet_port, pod_network)
        (self.cni_dir / "10-gpushare-e2e.conflist").write_text(json.dumps(network) + "\n")
        # with a pod network, the plugins' directory; without, the config's (no binary)
        cni_bin = CNI_BIN if pod_network else self.cni_dir
        cri = "plugins.'io.containerd.cri.v1.runtime'"
        runc = f"{cri}.containerd.runtimes.runc"
        lines = [
            "version = 4",
            f"root = {_toml(self.dir / 'root')}",
            f"state = {_toml(self.dir / 'state')}",
            f"disabled_plugins = {_toml(DISABLED_PLUGINS)}",
            f"temp = {_toml(self.dir / 'tmp')}",
            # version 4: the servers are plugins (no [grpc]/[ttrpc] tables)
            "[plugins.'io.containerd.server.v1.grpc']",
            f"  address = {_toml(self.socket)}",
            "[plugins.'io.containerd.server.v1.ttrpc']",
            f"  address = {_toml(str(self.socket) + '.ttrpc')}",
            "[plugins.'io.containerd.server.v1.debug']",
            '  address = ""',
            "[plugins.'io.containerd.internal.v1.opt']",
            f"  path = {_toml(self.dir / 'opt')}",
            "[plugins.'io.containerd.shim.v1.manager']",
            f"  socket_dir = {_toml(self.socket_dir)}",
            f"[{cri}]",
            f"  cdi_spec_dirs = {_toml([self.node.cdi_dir])}",
            # this VM does not let runc lower oom_score_adj ("Permission denied")
            "  restrict_oom_score_adj = true",
            # the pods' network namespaces pinned in the node's state, not /var/run/netns
            "  netns_mounts_under_state_dir = true",
            f"[{cri}.containerd]",
            '  default_runtime_name = "runc"',
            f"[{runc}]",
            '  runtime_type = "io.containerd.runc.v2"',
            f"[{runc}.options]",
            f"  BinaryName = {_toml(RUNTIME_BIN / 'runc')}",
            f"  Root = {_toml(self.runc_root)}",
            "  SystemdCgroup = false",
            f"[{cri}.cni]",
            f"  conf_dir = {_toml(self.cni_dir)}",
            f"  bin_dirs = {_toml([cni_bin])}",
            "[plugins.'io.containerd.cri.v1.images']",
            f"  snapshotter = {_toml(self.snapshotter)}",
            "[plugins.'io.containerd.cri.v1.images'.pinned_images]",
            f"  sandbox = {_toml(IMAGE)}",
            "[plugins.'io.containerd.grpc.v1.cri']",
            '  stream_server_address = "127.0.0.1"',
            '  stream_server_port = "0"',
        ]
        self.config.write_text("\n".join(lines) + "\n")
        return self.config

    def env(self) -> dict[str, str]:
        """containerd finds its shim on PATH; runc's path is in the config."""
        env = dict(os.environ)
        env["PATH"] = f"{RUNTIME_BIN}:{env.get('PATH', '/usr/bin:/bin')}"
        return env

    def ctr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``ctr`` against this node's containerd, in the ``k8s.io`` namespace (the CRI's)."""
        return subprocess.run(
            [str(RUNTIME_BIN / "ctr"), "--address", str(self.socket), "-n", "k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def import_image(self, tar: Path, timeout: float = 120) -> str:
        """Import a docker-archive or OCI tar into the node's containerd, unpacked for the
        CRI's snapshotter (what the image engineer's `make image` tar needs too). Returns
        ctr's output; raises with it on failure. The gpushare image (374 MB in 6 layers)
        takes about 100 s on 2 busy cores with ``native`` (the whole tree copied for every
        layer), seconds with ``overlayfs``."""
        # --local: ctr unpacks itself (through the transfer service, containerd 2.4 answers
        # "no unpack platforms defined" unless its config lists them)
        done = self.ctr(
            "images", "import", "--local", "--snapshotter", self.snapshotter, str(tar),
            timeout=timeout,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"ctr images import {tar}: {done.returncode} {done.stderr}")
        return done.stdout

    def containers(self) -> list[str]:
        """The container IDs runc knows on this node (sandboxes included)."""
        ns_root = self.runc_root / "k8s.io"
        if not ns_root.is_dir():
            return []
        return sorted(p.name for p in ns_root.iterdir() if p.is_dir())

    def shims(self) -> list[int]:
        """PIDs of this node's shims: processes of containerd-shim-runc-v2 whose command line
        names this node's containerd socket (each node has its own)."""
        pids = []
        exe = str(RUNTIME_BIN / "containerd-shim-runc-v2")
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            words = [a.decode(errors="replace") for a in argv]
            if words and words[0] == exe and str(self.socket) in words:
                pids.append(int(entry.name))
        return pids

    def clean_up(self) -> None:
        """After the kubelet and containerd stopped: every container of the node killed and
        deleted by runc, then the shims left killed (each by its PID). The node's mount
        namespace then ends with its holder."""
        for cid in self.containers():
            subprocess.run(
                [str(RUNTIME_BIN / "runc"), "--root", str(self.runc_root / "k8s.io"),
                 "delete", "--force", cid],
                capture_output=True, timeout=60, check=False,
            )  # fmt: skip
        for pid in self.shims():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
