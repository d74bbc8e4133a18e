"""The daemon's own API-server client, against the API-server double over real HTTP(S)."""

from __future__ import annotations

import base64
import shutil
import ssl
import subprocess
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import TESLA_P4, Node, cards
from kit.kube_double import KubeApiDouble
from kit.procs import daemon_command, poll

from gpushare.kube.podspecs import PodSpecBook
from gpushare.kube.podwatch import PodWatch
from gpushare.kube.stdlibclient import (
    ApiClient,
    ApiStatusError,
    KubeConfigError,
    in_cluster_endpoint,
    kubeconfig_endpoint,
    load_endpoint,
)
from gpushare.share.usage import Holder

NODE = "gpu-node-1"


@pytest.fixture
def api() -> Iterator[KubeApiDouble]:
    double = KubeApiDouble()
    double.start()
    double.add({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    try:
        yield double
    finally:
        double.stop()


def client_of(api: KubeApiDouble, tmp: Path, **kubeconfig: Any) -> ApiClient:
    return ApiClient(kubeconfig_endpoint(api.kubeconfig(tmp / "kubeconfig", **kubeconfig)))


def pod(name: str, node: str = NODE, memory: int = 4) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "nodeName": node,
            "containers": [
                {"name": "main", "resources": {"limits": {"gpushare.io/vcuda-memory": str(memory)}}}
            ],
        },
        "status": {"phase": "Pending"},
    }


def test_get_and_merge_patch_with_a_bearer_token(api: KubeApiDouble, short_tmp: Path) -> None:
    client = client_of(api, short_tmp)
    node = client.get(f"/api/v1/nodes/{NODE}")
    assert node["metadata"]["name"] == NODE
    client.merge_patch(f"/api/v1/nodes/{NODE}", {"metadata": {"labels": {"a": "b"}}})
    assert api.get("Node", NODE)["metadata"]["labels"] == {"a": "b"}
    patch = api.calls("PATCH")[-1]
    assert patch.content_type == "application/merge-patch+json"
    assert {r.authorization for r in api.requests} == {"Bearer test-token"}


def test_error_statuses_carry_the_code_and_the_servers_message(
    api: KubeApiDouble, short_tmp: Path
) -> None:
    client = client_of(api, short_tmp)
    with pytest.raises(ApiStatusError) as missing:
        client.get("/api/v1/nodes/nope")
    assert (
        missing.value.status == 404
        and str(missing.value) == "404 Not Found: nope not found"
        and "found" in str(missing.value)
    )
    api.fail_next(1, status=503)
    with pytest.raises(ApiStatusError) as busy:
        client.get(f"/api/v1/nodes/{NODE}")
    assert busy.value.status == 503
    assert client.get(f"/api/v1/nodes/{NODE}")["metadata"]["name"] == NODE  # still usable


def test_a_server_that_closed_a_kept_connection_is_retried_once(
    api: KubeApiDouble, short_tmp: Path
) -> None:
    client = client_of(api, short_tmp)
    client.get(f"/api/v1/nodes/{NODE}")
    for conn in client._idle:  # the server side went away meanwhile
        assert conn.sock is not None
        conn.sock.close()
    assert client.get(f"/api/v1/nodes/{NODE}")["metadata"]["name"] == NODE


def test_unreachable_server_raises_an_os_error(short_tmp: Path) -> None:
    double = KubeApiDouble()
    double.start()
    client = client_of(double, short_tmp)
    double.stop()
    with pytest.raises(OSError):
        client.get("/api/v1/nodes", timeout=2)


# --------------------------------------------------------------------------- loading


def test_in_cluster_endpoint_reads_the_token_file_for_every_connection(
    short_tmp: Path,
) -> None:
    account = short_tmp / "sa"
    account.mkdir()
    (account / "token").write_text("first\n")
    ca = _self_signed(short_tmp)
    shutil.copy(ca.cert, account / "ca.crt")
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "6443"}
    endpoint = in_cluster_endpoint(env, account)
    assert (endpoint.scheme, endpoint.host, endpoint.port) == ("https", "fd00::1", 6443)
    assert endpoint.bearer() == "first"
    (account / "token").write_text("rotated")
    assert endpoint.bearer() == "rotated"


def test_in_cluster_without_a_service_account_is_one_clear_error(short_tmp: Path) -> None:
    with pytest.raises(KubeConfigError, match="service account"):
        in_cluster_endpoint({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}, short_tmp)


def test_kubeconfig_is_chosen_over_in_cluster_when_named(
    api: KubeApiDouble, short_tmp: Path
) -> None:
    path = api.kubeconfig(short_tmp / "kc")
    env = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBECONFIG": f"{path}:/nonexistent"}
    assert load_endpoint(env).describe() == api.url


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- a list", "not a kubeconfig"),
        ("{current-context: x}", "no context named 'x'"),
        (
            "{current-context: c, contexts: [{name: c, context: {cluster: k, user: u}}],"
            " clusters: [{name: k, cluster: {server: 'https://h'}}],"
            " users: [{name: u, user: {exec: {command: aws}}}]}",
            "exec and auth-provider credentials are not supported",
        ),
        (
            "{current-context: c, contexts: [{name: c, context: {cluster: k}}],"
            " clusters: [{name: k, cluster: {server: 'h:6443'}}]}",
            "is not a URL",
        ),
        ("{a: [", "is not YAML"),
    ],
)
def test_unusable_kubeconfigs_are_one_line(short_tmp: Path, text: str, message: str) -> None:
    path = short_tmp / "kc"
    path.write_text(text)
    with pytest.raises(KubeConfigError, match=message) as error:
        kubeconfig_endpoint(path)
    assert "\n" not in str(error.value)


class Pki:
    def __init__(self, cert: Path, key: Path) -> None:
        self.cert, self.key = cert, key


def _self_signed(tmp: Path, name: str = "server") -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    cert, key = tmp / f"{name}.crt", tmp / f"{name}.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"),
            *("-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1"),
            *("-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    return Pki(cert, key)


def test_https_with_inline_ca_and_client_certificate(short_tmp: Path) -> None:
    server, client_pki = _self_signed(short_tmp), _self_signed(short_tmp, "client")
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(server.cert, server.key)
    tls.load_verify_locations(client_pki.cert)
    tls.verify_mode = ssl.CERT_REQUIRED
    double = KubeApiDouble()
    double.start(tls)
    double.add({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    try:
        client = client_of(
            double,
            short_tmp,
            cluster={"certificate-authority-data": b64(server.cert)},
            user={
                "client-certificate-data": b64(client_pki.cert),
                "client-key": str(client_pki.key),
            },
        )
        assert client.get(f"/api/v1/nodes/{NODE}")["metadata"]["name"] == NODE
        assert double.requests[-1].client_cert and not double.requests[-1].authorization
        stranger = client_of(double, short_tmp)  # no CA: the server is not trusted
        with pytest.raises(ssl.SSLError):
            stranger.get(f"/api/v1/nodes/{NODE}")
    finally:
        double.stop()


# --------------------------------------------------------------------------- watch


def eventually(check: Callable[[], Any], timeout: float = 30.0) -> None:
    assert poll(lambda: bool(check()), timeout), f"not true within {timeout} s"


@pytest.fixture
def watched(api: KubeApiDouble, short_tmp: Path) -> Iterator[tuple[PodSpecBook, PodWatch]]:
    client = client_of(api, short_tmp)
    book = PodSpecBook("gpushare.io")
    watch = PodWatch(lambda: client, NODE, book)
    watch.start()
    try:
        yield book, watch
    finally:
        watch.stop()


def test_the_watch_follows_pods_of_this_node_from_the_lists_version(
    api: KubeApiDouble, watched: tuple[PodSpecBook, PodWatch]
) -> None:
    book, _watch = watched
    api.add(pod("before"))
    eventually(lambda: len(book) == 1)  # listed (or watched) once started
    api.add(pod("elsewhere", node="other-node"))
    api.add(pod("a"))
    eventually(lambda: len(book) == 2)
    api.delete("Pod", "before", "default")
    api.add(pod("b"))
    gone = Holder("default", "before", "main")
    eventually(lambda: len(book) == 2 and book.requests_of(gone) is None)
    lists = [r for r in api.calls("GET", "/api/v1/pods") if "watch" not in r.query]
    watches = [r for r in api.calls("GET", "/api/v1/pods") if "watch" in r.query]
    assert len(lists) == 1  # changes arrive by the watch, not by listing again
    first = watches[0].query
    assert first["fieldSelector"] == [
        f"spec.nodeName={NODE},status.phase!=Succeeded,status.phase!=Failed"
    ]
    assert first["allowWatchBookmarks"] == ["true"]
    assert first["resourceVersion"][0]  # from the list's version, not "now"


def test_a_watch_ended_by_the_server_resumes_from_the_last_version_seen(
    api: KubeApiDouble, watched: tuple[PodSpecBook, PodWatch], monkeypatch: pytest.MonkeyPatch
) -> None:
    book, watch = watched
    api.add(pod("a"))
    # the pod may come by the first list, before the watch is open: wait for both
    eventually(lambda: len(book) == 1 and watch._current is not None)
    seen = watch._resume
    current = watch._current
    assert current is not None
    current.close()  # as a server timeout would end it
    eventually(lambda: watch._current is not None and watch._current is not current)
    api.add(pod("b"))
    eventually(lambda: len(book) == 2)
    resumed = [r for r in api.calls("GET", "/api/v1/pods") if "watch" in r.query][1]
    assert resumed.query["resourceVersion"] == [seen]
    assert len([r for r in api.calls("GET", "/api/v1/pods") if "watch" not in r.query]) == 1


def test_bookmarks_move_the_resume_version_forward(short_tmp: Path) -> None:
    double = KubeApiDouble()
    double.bookmark_seconds = 0.05
    double.start()
    try:
        client = client_of(double, short_tmp)
        book = PodSpecBook("gpushare.io")
        watch = PodWatch(lambda: client, NODE, book)
        watch.start()
        eventually(lambda: watch.listed.is_set())
        listed_at = int(watch._resume)
        double.add(pod("elsewhere", node="other-node"))  # a change this watch does not see
        eventually(lambda: int(watch._resume) > listed_at)
        watch.stop()
    finally:
        double.stop()


def test_an_expired_version_lists_again(
    api: KubeApiDouble, watched: tuple[PodSpecBook, PodWatch]
) -> None:
    book, watch = watched
    eventually(lambda: watch._current is not None)
    api.compact()
    api.add(pod("a"))
    api.compact()
    current = watch._current
    assert current is not None
    current.close()  # the next watch starts from a compacted version: 410
    eventually(lambda: len(book) == 1)
    lists = [r for r in api.calls("GET", "/api/v1/pods") if "watch" not in r.query]
    assert len(lists) >= 2


def test_an_on_demand_list_fills_the_book_and_the_watch_resumes_after_it(
    api: KubeApiDouble, watched: tuple[PodSpecBook, PodWatch]
) -> None:
    book, watch = watched
    eventually(lambda: watch._current is not None)
    api.add(pod("a"))
    assert watch.refresh_now()
    assert len(book) == 1
    assert not watch.refresh_now()  # rate-limited
    api.add(pod("b"))
    eventually(lambda: len(book) == 2)


def test_the_watch_retries_with_backoff_while_the_server_fails(
    api: KubeApiDouble, short_tmp: Path
) -> None:
    api.fail_next(2, status=500)
    client = client_of(api, short_tmp)
    book = PodSpecBook("gpushare.io")
    api.add(pod("a"))
    watch = PodWatch(lambda: client, NODE, book)
    monkey = pytest.MonkeyPatch()
    monkey.setattr("gpushare.kube.watching.random.uniform", lambda _a, _b: 0.01)
    try:
        watch.start()
        eventually(lambda: len(book) == 1)
    finally:
        watch.stop()
        monkey.undo()


# --------------------------------------------------------------------------- import path

START_WITH_API_LINK = textwrap.dedent(
    """
    import sys
    from gpushare.config import load_settings
    from gpushare.daemon import Daemon
    daemon = Daemon(load_settings(sys.argv[1:]))
    daemon.start()
    registered = daemon.plugin.link.registered.wait(20)
    published = daemon.core.api_link.published.wait(20)
    listed = daemon.core.api_link.pods.listed.wait(20)
    slow = sorted(m for m in sys.modules if m.split(".")[0] == "kubernetes")
    daemon.stop()
    print(registered, published, listed, slow, flush=True)
    """
)


def test_the_daemon_with_its_api_link_never_imports_kubernetes(
    node: Node, api: KubeApiDouble, short_tmp: Path
) -> None:
    node.write_gpus(cards(TESLA_P4, 2))
    node.kubelet.start()
    command = daemon_command(node, "--log-level", "error")
    command[1:3] = ["-c", START_WITH_API_LINK]
    env = {
        "PATH": "/usr/bin:/bin",
        "NODE_NAME": NODE,
        "KUBECONFIG": str(api.kubeconfig(short_tmp / "kubeconfig")),
    }
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "True True True []"


def test_the_pages_of_a_list_share_one_kept_alive_connection(
    api: KubeApiDouble, short_tmp: Path
) -> None:
    for index in range(7):
        api.add(pod(f"p{index}"))
    client = client_of(api, short_tmp)
    names, token = [], ""
    while True:
        query = {"limit": "2", **({"continue": token} if token else {})}
        with client.stream_list("/api/v1/pods", query, 10.0) as stream:
            names += [item["metadata"]["name"] for item in stream.items()]
            token = str(stream.fields["metadata"].get("continue") or "")
        if not token:
            break
    assert sorted(names) == [f"p{index}" for index in range(7)]
    lists = [r for r in api.requests if r.path == "/api/v1/pods"]
    assert len(lists) == 4
    assert len({r.port for r in lists}) == 1  # one connection for the four pages
    # a list whose reader failed half-way is not handed back: the next request opens
    # a fresh connection
    with pytest.raises(ValueError), client.stream_list("/api/v1/pods", {"limit": "5"}, 10.0) as s:
        next(s.items())
        raise ValueError("the reader gave up")
    assert client.get(f"/api/v1/nodes/{NODE}")["metadata"]["name"] == NODE
    ports = [r.port for r in api.requests if r.path in ("/api/v1/pods", f"/api/v1/nodes/{NODE}")]
    assert ports[-1] != ports[-2]
