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


def gate_flag(gates: dict[str, bool]) -> str:
    """``--feature-gates``' value for ``gates``."""
    return ",".join(f"{k}={str(v).lower()}" for k, v in gates.items())


def etcd_argv(bin_dir: Path, data_dir: Path, client: int, peer: int) -> list[str]:
    """etcd for one API server on loopback: client on ``client``, peer on ``peer``,
    no fsync (test data)."""
    url = f"http://127.0.0.1:{client}"
    return [
        str(bin_dir / "etcd"),
        "--name", "e2e",
        "--data-dir", str(data_dir),
        "--listen-client-urls", url,
        "--advertise-client-urls", url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"e2e=http://127.0.0.1:{peer}",
        "--unsafe-no-fsync", "--log-level", "warn",
    ]  # fmt: skip


def apiserver_argv(
    bin_dir: Path,
    etcd_url: str,
    port: int,
    cert_dir: Path,
    tokens: Path,
    key: Path,
    gates: dict[str, bool],
) -> list[str]:
    """kube-apiserver on 127.0.0.1:``port`` over ``etcd_url``: its serving certificate
    made in ``cert_dir`` (``apiserver.crt`` is the CA a client trusts), static tokens
    from ``tokens`` (``token,user,uid,"groups"`` lines), the service-account key
    ``key``, Node and RBAC authorization with NodeRestriction. Shared by the e2e
    cluster (tests/e2e/kube_cluster.py), the DRA tests, ``make bench`` and ``make scale``."""
    return [
        str(bin_dir / "kube-apiserver"),
        "--etcd-servers", etcd_url,
        "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
        "--secure-port", str(port), "--cert-dir", str(cert_dir),
        "--token-auth-file", str(tokens),
        "--authorization-mode", "Node,RBAC",
        "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
        "--service-account-key-file", str(key),
        "--service-account-signing-key-file", str(key),
        "--service-cluster-ip-range", "10.96.0.0/16",
        "--enable-admission-plugins", "NodeRestriction",
        "--feature-gates", gate_flag(gates),
        "--profiling=false",
        # The `kubernetes` Service's endpoints would be the advertise address, here
        # loopback: 1.36 logs "may not be in the loopback range" every 10 s, 1.37 refuses
        # to start with it. Nothing here reaches the API server through the Service
        # (every client has a kubeconfig), so no endpoint reconciler.
        "--endpoint-reconciler-type=none",
    ]  # fmt: skip


def make_key(path: Path) -> None:
    """The service-account signing key (RSA 2048, openssl)."""
    subprocess.run(
        ["openssl", "genrsa", "-out", str(path), "2048"], check=True, capture_output=True
    )


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
        self.gates = gate_flag(gates)
        client, peer = free_port(), free_port()
        etcd = f"http://127.0.0.1:{client}"
        self._spawn("etcd", [*etcd_argv(self.bin, root / "etcd", client, peer), *etcd_flags])
        key = root / "sa.key"
        make_key(key)
        (root / "tokens.csv").write_text(
            f'{self.admin_token},admin,admin,"system:masters"\n'
            f'{self.node_token},system:node:{node},node-{node},"system:nodes"\n'
        )
        self.port = free_port()
        certs = root / "certs"
        argv = apiserver_argv(self.bin, etcd, self.port, certs, root / "tokens.csv", key, gates)
        self._spawn("kube-apiserver", [*argv, *apiserver_flags])
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

    def start_scheduler(self, *extra: str) -> None:
        """Start kube-scheduler; ``extra``: more of its flags."""
        self._spawn(
            "kube-scheduler",
            [
                str(self.bin / "kube-scheduler"),
                "--kubeconfig", str(self.kubeconfig("admin", self.admin_token)),
                "--leader-elect=false", "--secure-port", "0",
                "--feature-gates", self.gates,
                *extra,
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
