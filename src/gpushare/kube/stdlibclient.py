"""The node daemon's own API-server client: HTTP/JSON over the standard library.

The daemon makes a handful of calls (read its Node, merge-patch it and its pods, list
and watch the pods of its node). The ``kubernetes`` package would cost about 38 MiB and
a second of start for them; this module uses ``http.client`` and ``ssl`` and keeps the
server's JSON as it comes. ``kubectl gpushare`` and the cluster-side tools keep using
``kubernetes`` (see ``kubectlapi.py``).

Where the server and the credentials come from (:func:`load_endpoint`):

* in a pod (``KUBERNETES_SERVICE_HOST`` set, no ``KUBECONFIG``): the service account's
  token and CA in ``/var/run/secrets/kubernetes.io/serviceaccount``, the server at
  ``KUBERNETES_SERVICE_HOST:KUBERNETES_SERVICE_PORT``; the token file is read again
  for every connection, as projected tokens rotate;
* otherwise the current context of ``$KUBECONFIG`` (its first file) or ``~/.kube/config``:
  ``server``, ``certificate-authority(-data)``, ``insecure-skip-tls-verify``, and a
  ``token``/``tokenFile`` or ``client-certificate(-data)`` + ``client-key(-data)``.
  Exec and auth-provider plugins are not supported (one clear error).

A watch (:meth:`ApiClient.watch`) is a GET with ``watch=1`` whose answer is one JSON
event per line; the caller resumes from the last ``resourceVersion`` it saw.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import socket
import ssl
import tempfile
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import yaml

from gpushare.kube.jsonstream import ListStream
from gpushare.kube.protolist import PROTOBUF, ProtoListStream

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: The longest line a watch may send (one pod as JSON is a few KiB; this bounds a bad one).
MAX_EVENT_BYTES = 16 << 20
MERGE_PATCH = "application/merge-patch+json"


class KubeConfigError(Exception):
    """No usable in-cluster or kubeconfig credentials; the message says why."""


class ApiStatusError(Exception):
    """The API server answered with an error status."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}" + (f": {message}" if message else ""))
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Endpoint:
    """Where the API server is and how to authenticate to it."""

    scheme: str  # "https" or "http"
    host: str
    port: int
    base_path: str = ""  # a server URL may carry a path (proxies)
    context: ssl.SSLContext | None = None
    token: str = ""
    token_file: Path | None = None

    def bearer(self) -> str:
        """The current token: a token file is re-read, since projected tokens rotate."""
        if self.token_file is not None:
            try:
                return self.token_file.read_text().strip()
            except OSError as exc:
                raise KubeConfigError(f"cannot read the token {self.token_file}: {exc}") from None
        return self.token

    def describe(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}{self.base_path}"


# --------------------------------------------------------------------------- loading


def load_endpoint(environ: Mapping[str, str] | None = None) -> Endpoint:
    """The in-cluster endpoint inside a pod, else the kubeconfig's current context."""
    env = os.environ if environ is None else environ
    if env.get("KUBERNETES_SERVICE_HOST") and not env.get("KUBECONFIG"):
        return in_cluster_endpoint(env)
    paths = [p for p in (env.get("KUBECONFIG") or "").split(os.pathsep) if p]
    path = Path(paths[0] if paths else "~/.kube/config").expanduser()
    return kubeconfig_endpoint(path)


def in_cluster_endpoint(
    environ: Mapping[str, str], account_dir: Path = SERVICE_ACCOUNT_DIR
) -> Endpoint:
    host = environ.get("KUBERNETES_SERVICE_HOST", "")
    port = environ.get("KUBERNETES_SERVICE_PORT", "443")
    token, ca = account_dir / "token", account_dir / "ca.crt"
    if not host or not token.exists() or not ca.exists():
        raise KubeConfigError(
            f"not in a pod with a service account: KUBERNETES_SERVICE_HOST={host!r}, "
            f"{token} and {ca} needed"
        )
    try:
        context = ssl.create_default_context(cafile=str(ca))
        number = int(port)
    except (OSError, ssl.SSLError, ValueError) as exc:
        raise KubeConfigError(f"unusable in-cluster settings: {exc}") from None
    return Endpoint("https", host.strip("[]"), number, context=context, token_file=token)


def _named(items: Any, name: str, what: str, path: Path) -> dict[str, Any]:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            inner = item.get(what)
            return inner if isinstance(inner, dict) else {}
    raise KubeConfigError(f"{path}: no {what} named {name!r}")


def _material(section: Mapping[str, Any], key: str, base: Path) -> tuple[str | None, bytes | None]:
    """``key`` as a file path (relative to the kubeconfig) or ``key-data`` as bytes."""
    data = section.get(f"{key}-data")
    if data:
        try:
            return None, base64.b64decode(str(data), validate=True)
        except ValueError:
            raise KubeConfigError(f"{key}-data is not base64") from None
    value = section.get(key)
    if value:
        return str((base / str(value)).expanduser()), None
    return None, None


def kubeconfig_endpoint(path: Path, context_name: str | None = None) -> Endpoint:
    """The endpoint of ``context_name`` (else the current context) of the kubeconfig."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise KubeConfigError(f"no kubeconfig at {path}: {exc.strerror or exc}") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise KubeConfigError(f"{path} is not YAML: {str(exc).splitlines()[0]}") from None
    if not isinstance(config, dict):
        raise KubeConfigError(f"{path} is not a kubeconfig")
    current = context_name or config.get("current-context")
    if not current:
        raise KubeConfigError(f"{path} has no current-context")
    context = _named(config.get("contexts"), str(current), "context", path)
    cluster = _named(config.get("clusters"), str(context.get("cluster")), "cluster", path)
    user = (
        _named(config.get("users"), str(context["user"]), "user", path)
        if context.get("user")
        else {}
    )
    if user.get("exec") or user.get("auth-provider"):
        raise KubeConfigError(
            f"{path}: exec and auth-provider credentials are not supported by the daemon; "
            "use a token or a client certificate"
        )
    server = urlsplit(str(cluster.get("server") or ""))
    if server.scheme not in ("http", "https") or not server.hostname:
        raise KubeConfigError(f"{path}: cluster server {cluster.get('server')!r} is not a URL")
    base = path.parent
    ssl_context = None
    if server.scheme == "https":
        ssl_context = _tls_context(cluster, user, base)
    token_file = user.get("tokenFile")
    return Endpoint(
        server.scheme,
        server.hostname,
        server.port or (443 if server.scheme == "https" else 80),
        base_path=server.path.rstrip("/"),
        context=ssl_context,
        token=str(user.get("token") or ""),
        token_file=(base / str(token_file)).expanduser() if token_file else None,
    )


def _tls_context(cluster: Mapping[str, Any], user: Mapping[str, Any], base: Path) -> ssl.SSLContext:
    ca_file, ca_data = _material(cluster, "certificate-authority", base)
    try:
        context = ssl.create_default_context(
            cafile=ca_file, cadata=ca_data.decode() if ca_data else None
        )
        if cluster.get("insecure-skip-tls-verify"):
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        cert_file, cert_data = _material(user, "client-certificate", base)
        key_file, key_data = _material(user, "client-key", base)
        if cert_file or cert_data:
            _load_client_cert(context, cert_file, cert_data, key_file, key_data)
    except (OSError, ssl.SSLError, UnicodeDecodeError) as exc:
        raise KubeConfigError(f"unusable TLS settings in the kubeconfig: {exc}") from None
    return context


def _load_client_cert(
    context: ssl.SSLContext,
    cert_file: str | None,
    cert_data: bytes | None,
    key_file: str | None,
    key_data: bytes | None,
) -> None:
    """``ssl`` loads certificates from files only: inline data goes through a private
    temporary directory that is removed at once."""
    with tempfile.TemporaryDirectory(prefix="gpushare-kube-") as tmp:
        if cert_data is not None:
            cert_file = os.path.join(tmp, "cert.pem")
            Path(cert_file).write_bytes(cert_data)
        if key_data is not None:
            key_file = os.path.join(tmp, "key.pem")
            fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(key_data)
        assert cert_file is not None
        context.load_cert_chain(cert_file, key_file)


# --------------------------------------------------------------------------- client


def _error_of(status: int, reason: str, data: bytes) -> ApiStatusError:
    message = ""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        message = str(json.loads(data).get("message") or "")
    return ApiStatusError(status, reason, message.replace("\n", " ")[:500])


JSON = "application/json"
#: A list's and a watch's objects as their metadata only (``PartialObjectMetadata``:
#: name, uid, labels, annotations; no spec or status): the server sends each object's
#: small part, and plain JSON where it cannot (the last choice).
METADATA_LIST = (
    "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
)
METADATA_WATCH = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1,application/json"


class ApiClient:
    """A few JSON requests to one API server, over a small pool of kept-alive connections.

    Thread-safe: each request takes an idle connection (or opens one) and gives it back
    when the answer was read in full.
    """

    def __init__(self, endpoint: Endpoint, metadata_only: bool = False) -> None:
        """``metadata_only``: a client that only lists and watches, and reads no more of
        each object than its metadata (:data:`METADATA_LIST`, :data:`METADATA_WATCH`)."""
        self.endpoint = endpoint
        self._accept = METADATA_LIST if metadata_only else JSON
        self._watch_accept = METADATA_WATCH if metadata_only else JSON
        self._idle: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        e = self.endpoint
        if e.scheme == "https":
            return http.client.HTTPSConnection(e.host, e.port, timeout=timeout, context=e.context)
        return http.client.HTTPConnection(e.host, e.port, timeout=timeout)

    def _headers(self, content_type: str | None, accept: str = "") -> dict[str, str]:
        headers = {"Accept": accept or self._accept, "User-Agent": "gpushare-device-plugin"}
        token = self.endpoint.bearer()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def url(self, path: str, query: Mapping[str, str] | None = None) -> str:
        return self.endpoint.base_path + path + (f"?{urlencode(query)}" if query else "")

    def request(
        self,
        method: str,
        path: str,
        *,
        query: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str | None = None,
        timeout: float = 5.0,
        raw: bool = False,
    ) -> Any:
        """Send one request; the answer's JSON (``raw``: its text). Raises
        :class:`ApiStatusError` for an error status, ``OSError`` (or
        ``http.client.HTTPException``) when unreachable."""
        data = json.dumps(body).encode() if body is not None else None
        headers = self._headers(content_type if data is not None else None)
        url = self.url(path, query)
        for attempt in (1, 2):
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            reused = conn is not None
            conn = conn or self._connect(timeout)
            try:
                if conn.sock is not None:
                    conn.sock.settimeout(timeout)
                conn.timeout = timeout
                conn.request(method, url, body=data, headers=headers)
                response = conn.getresponse()
                answer = response.read()
            except TimeoutError:
                conn.close()
                raise  # a server that does not answer in time gets no second full wait
            except (OSError, http.client.HTTPException):
                conn.close()
                if reused and attempt == 1:
                    continue  # the server closed a kept-alive connection: once more, fresh
                raise
            if response.will_close:
                conn.close()
            else:
                with self._lock:
                    self._idle.append(conn)
            if response.status >= 400:
                raise _error_of(response.status, response.reason, answer)
            if raw:
                return answer.decode("utf-8", errors="replace")
            return json.loads(answer) if answer else {}
        raise AssertionError("unreachable")  # pragma: no cover

    def get(self, path: str, timeout: float = 5.0, **query: str) -> Any:
        return self.request("GET", path, query=query or None, timeout=timeout)

    def merge_patch(self, path: str, body: Mapping[str, Any], timeout: float = 5.0) -> Any:
        return self.request("PATCH", path, body=body, content_type=MERGE_PATCH, timeout=timeout)

    def watch(self, path: str, query: Mapping[str, str], read_timeout: float) -> Watch:
        """Open a watch (``watch=1`` is added); raises like :meth:`request` on failure."""
        conn = self._connect(read_timeout)
        try:
            conn.request(
                "GET",
                self.url(path, {**query, "watch": "1"}),
                headers=self._headers(None, self._watch_accept),
            )
            response = conn.getresponse()
            if response.status >= 400:
                raise _error_of(response.status, response.reason, response.read())
        except BaseException:
            conn.close()
            raise
        return Watch(conn, response)

    @contextlib.contextmanager
    def stream_list(
        self, path: str, query: Mapping[str, str], timeout: float
    ) -> Iterator[ListStream]:
        """GET a list as JSON and read its items one at a time (:class:`ListStream`;
        see :meth:`stream_list_as`)."""
        with self.stream_list_as(path, query, timeout, self._accept) as stream:
            if not isinstance(stream, ListStream):
                raise ValueError(f"{path}: a protobuf answer to a request for JSON")
            yield stream

    @contextlib.contextmanager
    def stream_list_as(
        self, path: str, query: Mapping[str, str], timeout: float, accept: str
    ) -> Iterator[ListStream | ProtoListStream]:
        """GET a list and read its items one at a time: a large answer never sits in
        memory whole. A JSON answer comes as a :class:`ListStream`; with ``accept``
        naming protobuf (``protolist.PROTOBUF_OR_JSON``), a server that answers in
        protobuf comes as a :class:`ProtoListStream`. Raises like :meth:`request` on
        failure. The connection is a kept-alive one of the pool, and goes back to it
        once the answer was read to its end (the pages of one list then cost one TLS
        handshake, not one each: ~3 ms of CPU and, on a loaded machine, up to ~90 ms of
        wall time apiece)."""
        url = self.url(path, query)
        headers = self._headers(None, accept)
        with self._lock:
            conn = self._idle.pop() if self._idle else None
        reused = conn is not None
        conn = conn or self._connect(timeout)
        kept = False
        try:
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            conn.timeout = timeout
            try:
                conn.request("GET", url, headers=headers)
                response = conn.getresponse()
            except (OSError, http.client.HTTPException):
                if not reused:
                    raise
                conn.close()  # the server closed a kept-alive connection: once more, fresh
                conn = self._connect(timeout)
                conn.request("GET", url, headers=headers)
                response = conn.getresponse()
            if response.status >= 400:
                raise _error_of(response.status, response.reason, response.read(64 << 10))
            content_type = response.getheader("Content-Type", "").split(";")[0].strip()
            if content_type == PROTOBUF:
                yield ProtoListStream(response.read)
            else:
                yield ListStream(response.read)
            response.read(64 << 10)  # what follows the list's last brace (a newline)
            kept = response.isclosed() and not response.will_close
            if kept:
                with self._lock:
                    self._idle.append(conn)
        finally:
            if not kept:
                conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


class Watch:
    """One open watch: iterate for ``(type, object)`` events; :meth:`close` from any
    thread ends a read that is waiting."""

    def __init__(self, conn: http.client.HTTPConnection, response: http.client.HTTPResponse):
        self._conn = conn
        self._response = response
        self._sock = conn.sock
        self._closed = False

    def __iter__(self) -> Iterator[tuple[str, dict[str, Any]]]:
        try:
            while not self._closed:
                line = self._response.readline(MAX_EVENT_BYTES)
                if not line:
                    return  # the server ended the watch (its timeout): resume from the last RV
                if not line.endswith(b"\n") and len(line) >= MAX_EVENT_BYTES:
                    raise ValueError(f"a watch event longer than {MAX_EVENT_BYTES} bytes")
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object")
                if isinstance(kind, str) and isinstance(obj, dict):
                    yield kind, obj
        except (OSError, ValueError, http.client.HTTPException):
            if self._closed:
                return
            raise
        finally:
            self.close()

    def close(self) -> None:
        """End the watch; safe from another thread while a read waits."""
        if self._closed:
            return
        self._closed = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                socket.socket.shutdown(sock, socket.SHUT_RDWR)  # wakes a waiting read
        self._conn.close()
