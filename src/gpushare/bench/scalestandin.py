"""The stand-in API server of ``make scale`` (``--api stand-in``, or where the
Kubernetes binaries are absent): a small HTTP server answering the extender's paged pod
and node lists from pre-built JSON (:mod:`gpushare.bench.scaleobjects`) and holding its
watches open. It is not kube-apiserver: it measures the extender's side (parsing,
memory, the verbs), not the API server's. It serves no state objects (404: the extender
reads the Node annotations)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from gpushare.bench.scaleobjects import POD_TEXT, gpu_node, pod_fields

PAGE_LIMIT = 500


class ListStandIn:
    """Answers ``GET /api/v1/pods`` and ``/api/v1/nodes`` lists in pages of pre-built
    JSON, and holds every watch open (no events) until :meth:`stop`."""

    def __init__(self, nodes: int, pods: int, gpu_every: int = 4, prerender: bool = False) -> None:
        self.nodes = nodes
        self.pods = pods
        self.gpu_every = gpu_every
        self.lists: dict[str, int] = {"pods": 0, "nodes": 0}
        self._stop = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        #: pages of pods rendered before the extender starts (its start then measures the
        #: extender, not this process building JSON on the same cores)
        self._pages: dict[tuple[int, int], bytes] = {}
        if prerender:
            for start in range(0, pods, PAGE_LIMIT):
                self._pages[(start, PAGE_LIMIT)] = self.page("pods", start, PAGE_LIMIT)

    def _node(self, index: int) -> bytes:
        return json.dumps(gpu_node(index)).encode()

    def _pod(self, index: int) -> bytes:
        gpu = index % self.gpu_every == 0
        return (POD_TEXT[gpu] % pod_fields(index, self.nodes)).encode()

    def page(self, kind: str, start: int, limit: int) -> bytes:
        ready = self._pages.get((start, limit)) if kind == "pods" else None
        if ready is not None:
            return ready
        total = self.pods if kind == "pods" else self.nodes
        end = min(total, start + limit)
        build = self._pod if kind == "pods" else self._node
        items = b",".join(build(i) for i in range(start, end))
        meta: dict[str, str] = {"resourceVersion": "5000"}
        if end < total:
            meta["continue"] = str(end)
        head = f'{{"kind":"List","apiVersion":"v1","metadata":{json.dumps(meta)},"items":['
        return head.encode() + items + b"]}"

    def start(self) -> str:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                parsed = urlparse(self.path)
                query = parse_qs(parsed.query)
                kind = parsed.path.rstrip("/").rsplit("/", 1)[-1]
                if kind not in ("pods", "nodes"):
                    self.send_error(404)
                    return
                if (query.get("watch") or [""])[0] in ("1", "true"):
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    self.wfile.flush()
                    outer._stop.wait()
                    return
                start = int((query.get("continue") or ["0"])[0])
                if start == 0:
                    outer.lists[kind] += 1
                limit = int((query.get("limit") or [str(PAGE_LIMIT)])[0])
                body = outer.page(kind, start, limit)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
