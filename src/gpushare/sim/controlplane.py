"""A real control plane on loopback: etcd, kube-apiserver and kube-scheduler.

The binaries are the ones ``make e2e`` builds from Go modules (Kubernetes v1.36.3;
``$GPUSHARE_E2E_BIN``, default ``e2e/bin``). An admin token (``system:masters``) and one
node's own credentials (``system:node:<node>``, scoped by the Node authorizer and
NodeRestriction) are written as kubeconfigs. Used by the DRA tests against the real
server and scheduler and by ``make bench`` (a GET of a claim from the real server),
both skipped where the binaries are absent.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import yaml

from gpushare.kube.stdlibclient import ApiClient, ApiStatusError, kubeconfig_endpoint

#: e2e/bin (Kubernetes 1.36), or e2e/bin-<minor> for K8S_VERSION=<minor> (e2e/build.sh);
#: $GPUSHARE_E2E_BIN names any other folder.
_MINOR = os.environ.get("K8S_VERSION", "1.36")
_FOLDER = "bin" if _MINOR == "1.36" else f"bin-{_MINOR}"
BIN = Path(
    os.environ.get("GPUSHARE_E2E_BIN") or Path(__file__).resolve().parents[3] / "e2e" / _FOLDER
)
NEEDED = ("etcd", "kube-apiserver", "kube-scheduler")
T = TypeVar("T")


def available(bin_dir: Path = BIN) -> bool:
    return all((bin_dir / name).exists() for name in NEEDED)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def poll(what: str, probe: Callable[[], T | None], timeout: float = 60.0) -> T:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError, ApiStatusError, ValueError):
            found = probe()
            if found:
                return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.1)


class ControlPlane:
    """etcd, kube-apiserver and (optionally) kube-scheduler on loopback."""

    def __init__(
        self,
        root: Path,
        gates: dict[str, bool],
        bin_dir: Path = BIN,
        node: str = "node-1",
        etcd_flags: Sequence[str] = (),
        apiserver_flags: Sequence[str] = (),
    ) -> None:
        """``etcd_flags`` and ``apiserver_flags``: more flags for each (``make scale``
        raises etcd's storage quota)."""
        self.root = root
        self.bin = bin_dir
        self.node = node
        self.procs: list[subprocess.Popen[bytes]] = []
        self.admin_token = secrets.token_hex(16)
        self.node_token = secrets.token_hex(16)
        gate_text = ",".join(f"{k}={str(v).lower()}" for k, v in gates.items())
        self.gates = gate_text
        client, peer = free_port(), free_port()
        etcd = f"http://127.0.0.1:{client}"
        self._spawn(
            "etcd",
            [
                str(self.bin / "etcd"),
                "--data-dir", str(root / "etcd"),
                "--listen-client-urls", etcd,
                "--advertise-client-urls", etcd,
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"default=http://127.0.0.1:{peer}",
                "--unsafe-no-fsync", "--log-level", "warn",
                *etcd_flags,
            ],
        )  # fmt: skip
        key = root / "sa.key"
        subprocess.run(
            ["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True
        )
        (root / "tokens.csv").write_text(
            f'{self.admin_token},admin,admin,"system:masters"\n'
            f'{self.node_token},system:node:{node},node-{node},"system:nodes"\n'
        )
        self.port = free_port()
        certs = root / "certs"
        self._spawn(
            "kube-apiserver",
            [
                str(self.bin / "kube-apiserver"),
                "--etcd-servers", etcd,
                "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
                # no `kubernetes` Service endpoints: 1.37 refuses a loopback address for them
                "--endpoint-reconciler-type=none",
                "--secure-port", str(self.port), "--cert-dir", str(certs),
                "--token-auth-file", str(root / "tokens.csv"),
                "--authorization-mode", "Node,RBAC",
                "--service-account-issuer", "https://kubernetes.default.svc",
                "--service-account-key-file", str(key),
                "--service-account-signing-key-file", str(key),
                "--service-cluster-ip-range", "10.96.0.0/16",
                "--enable-admission-plugins", "NodeRestriction",
                "--feature-gates", gate_text, "--profiling=false",
                *apiserver_flags,
            ],
        )  # fmt: skip
        self.ca = certs / "apiserver.crt"
        poll("the API server's certificate", lambda: self.ca.exists(), 60)
        self.admin = ApiClient(kubeconfig_endpoint(self.kubeconfig("admin", self.admin_token)))
        poll(
            "kube-apiserver serving the default namespace",
            lambda: self.admin.get("/api/v1/namespaces/default"),
            120,
        )

    def kubeconfig(self, name: str, token: str) -> Path:
        path = self.root / f"{name}.kubeconfig"
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "c",
                    "clusters": [
                        {
                            "name": "c",
                            "cluster": {
                                "server": f"https://127.0.0.1:{self.port}",
                                "certificate-authority": str(self.ca),
                            },
                        }
                    ],
                    "users": [{"name": "u", "user": {"token": token}}],
                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                }
            )
        )
        return path

    def start_scheduler(self) -> None:
        self._spawn(
            "kube-scheduler",
            [
                str(self.bin / "kube-scheduler"),
                "--kubeconfig", str(self.kubeconfig("admin", self.admin_token)),
                "--leader-elect=false", "--secure-port", "0",
                "--feature-gates", self.gates,
            ],
        )  # fmt: skip

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = (self.root / f"{name}.log").open("ab")
        self.procs.append(
            subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.admin.close()

    def add_node(self) -> None:
        self.admin.request("POST", "/api/v1/nodes", body={"metadata": {"name": self.node}})
        room = {"cpu": "64", "memory": "256Gi", "pods": "250"}
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "e2e"}
        self.admin.request(
            "PATCH",
            f"/api/v1/nodes/{self.node}/status",
            body={"status": {"capacity": room, "allocatable": room, "conditions": [ready]}},
            content_type="application/merge-patch+json",
        )
        # TaintNodesByCondition tainted it not-ready at creation; no node lifecycle
        # controller runs here to lift it
        self.admin.request(
            "PATCH",
            f"/api/v1/nodes/{self.node}",
            body={"spec": {"taints": None}},
            content_type="application/merge-patch+json",
        )
        self.admin.request(
            "POST",
            "/api/v1/namespaces/default/serviceaccounts",
            body={"metadata": {"name": "default"}},
        )
