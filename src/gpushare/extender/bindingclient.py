"""Posting a pod's Binding to the API server, the one call the extender makes there.

``POST /api/v1/namespaces/{ns}/pods/{name}/binding`` with a v1 Binding that carries
the pod's UID, so a pod deleted and re-created under the same name gets 409 instead
of a wrong binding. The server answers 201 with a ``Status`` body; any other answer
is a refusal whose message goes back to the scheduler. (The ``kubernetes`` client
raises on that 201 although the pod is bound, hence this small aiohttp client.)

In a pod the address, the bound service-account token and the cluster CA come from
the usual places; the token is read again when its file changes (bound tokens
rotate).
"""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_TOKEN_FILE = f"{SA_DIR}/token"
DEFAULT_CA_FILE = f"{SA_DIR}/ca.crt"

#: Seconds for one Binding request; kube-scheduler's extender timeout is about 5 s.
TIMEOUT_SECONDS = 4.0


def in_cluster_url(env: dict[str, str] | None = None) -> str:
    """``https://<KUBERNETES_SERVICE_HOST>:<port>``, or "" outside a pod."""
    env = dict(os.environ) if env is None else env
    host, port = env.get("KUBERNETES_SERVICE_HOST", ""), env.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port:
        return ""
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


class BindError(Exception):
    """The API server did not bind the pod; the message says what it answered."""


@dataclass
class _Token:
    path: str
    mtime: float = -1.0
    value: str = ""

    def read(self) -> str:
        if not self.path:
            return ""
        try:
            mtime = os.stat(self.path).st_mtime
            if mtime != self.mtime:
                self.value = Path(self.path).read_text().strip()
                self.mtime = mtime
        except OSError as exc:
            raise BindError(f"cannot read the token {self.path}: {exc.strerror}") from None
        return self.value


class BindingClient:
    """One aiohttp session to the API server; create and close it on the serving loop."""

    def __init__(self, url: str, token_file: str = "", ca_file: str = "") -> None:
        self.url = url.rstrip("/")
        self._token = _Token(token_file)
        self._ca_file = ca_file
        self._session: aiohttp.ClientSession | None = None

    def _ssl(self) -> ssl.SSLContext | bool:
        if not self.url.startswith("https:"):
            return False
        return ssl.create_default_context(cafile=self._ca_file or None)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def bind(
        self,
        namespace: str,
        name: str,
        uid: str,
        node: str,
        annotations: dict[str, str] | None = None,
    ) -> None:
        """Bind the pod, adding ``annotations`` to it (the server merges a Binding's
        annotations into the pod's); a :class:`BindError` if the server did not."""
        if self._session is None:
            connector = aiohttp.TCPConnector(ssl=self._ssl(), limit=8)
            timeout = aiohttp.ClientTimeout(total=TIMEOUT_SECONDS)
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout)
        body: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": uid,
                **({"annotations": dict(annotations)} if annotations else {}),
            },
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        path = f"/api/v1/namespaces/{quote(namespace, safe='')}/pods/{quote(name, safe='')}/binding"
        headers = {"Accept": "application/json"}
        token = self._token.read()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        try:
            async with self._session.post(self.url + path, json=body, headers=headers) as answer:
                if answer.status in (200, 201):
                    return
                text = (await answer.content.read(64 << 10)).decode("utf-8", "replace")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise BindError(f"the API server could not be reached: {exc!r}"[:300]) from None
        raise BindError(f"the API server answered {answer.status}: {_message(text)}")


def _message(text: str) -> str:
    """The ``message`` of a Status body, else the start of the text."""
    try:
        status = json.loads(text)
    except ValueError:
        return text[:200]
    message = status.get("message") if isinstance(status, dict) else None
    return str(message)[:300] if message else text[:200]
