"""``gpushare-scheduler-extender``: the filter, prioritize and bind verbs over HTTP (aiohttp).

The HTTP layer only reads the body, calls the pure verbs (``verbs.py``) and answers.
A body it cannot use gets HTTP 400 (413 when too large) with a JSON message; it never
exits because of a request. Also served: ``/healthz``, ``/readyz`` and ``/metrics``.

Meant to run beside kube-scheduler and listen on 127.0.0.1 only (see
docs/multi-card.md): whoever reaches it can bind pending pods through it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gpushare.base.cli import Parser, add_version, bounded_float
from gpushare.base.connguard import ConnectionGuard, ConnectionLimits, GuardedFactory
from gpushare.base.logs import configure_logging
from gpushare.config import LOG_FORMATS, LOG_LEVELS
from gpushare.extender.bindingclient import (
    DEFAULT_CA_FILE,
    DEFAULT_TOKEN_FILE,
    BindError,
    BindingClient,
    in_cluster_url,
)
from gpushare.extender.body import BadRequest, parse_json
from gpushare.extender.extendermetrics import ExtenderMetrics
from gpushare.extender.fit import PLACEMENTS
from gpushare.extender.ledger import AdmissionLedger
from gpushare.extender.nodecache import NodeCache
from gpushare.extender.nodefeed import NodeFeed
from gpushare.extender.podfeed import PodFeed, endpoint_of
from gpushare.extender.statefeed import StateFeed
from gpushare.extender.verbs import (
    VERDICTS_KEY,
    BindRefused,
    ExtenderPolicy,
    ExtenderState,
    bind_verb,
    filter_verb,
    prioritize_verb,
)
from gpushare.kube import nodestate, stateobject
from gpushare.kube.stdlibclient import ApiClient

log = structlog.get_logger(__name__)

#: Default bound of a request body. Node names (nodeCacheCapable: true) take about 20
#: bytes a node, so any cluster fits; a NodeList of full Node objects (the older
#: configuration) fits a few hundred. The work and memory a body costs are linear in
#: its size, so this keeps one request well under the container's memory limit.
DEFAULT_MAX_BODY_BYTES = 4 << 20

DEFAULT_PORT = 9446
DEFAULT_LEDGER_TIMEOUT = 60.0


@dataclass(frozen=True)
class ExtenderSettings:
    address: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    url_prefix: str = "/gpushare"
    resource_prefix: str = "gpushare.io"
    placement: str = "binpack"
    ledger_timeout_seconds: float = DEFAULT_LEDGER_TIMEOUT
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    #: API server for the bind verb ("": in-cluster address, or binding disabled)
    api_server: str = ""
    token_file: str = DEFAULT_TOKEN_FILE
    ca_file: str = DEFAULT_CA_FILE
    #: a second listener serving only /healthz, /readyz and /metrics (0: none), for
    #: the kubelet's probes when the verbs listen on 127.0.0.1 inside a pod
    probe_address: str = "0.0.0.0"
    probe_port: int = 0
    #: watch the cluster's pods (bound, ended) to count what occupies each card; needs
    #: the API server (``api_server`` or in-cluster) and list/watch on pods
    watch_pods: bool = True
    #: watch the cluster's Nodes to answer requests that carry node names only
    #: (``nodeCacheCapable: true``); needs the API server and list/watch on nodes
    watch_nodes: bool = True
    #: the namespace of the daemons' state objects (ConfigMaps ``gpushare-node-<node>``,
    #: watched beside the Nodes; needs list/watch on configmaps there); "": the
    #: extender's own (POD_NAMESPACE, its service account's, else kube-system)
    state_namespace: str = ""

    @property
    def policy(self) -> ExtenderPolicy:
        return ExtenderPolicy(self.resource_prefix, self.placement)


def _route(prefix: str, verb: str) -> str:
    return "/" + "/".join(part for part in (prefix.strip("/"), verb) if part)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"Error": message}, status=status)


async def _read_json(request: web.Request) -> Any:
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise _TooLarge(str(exc.text or "")) from None
    return parse_json(raw)


class _TooLarge(Exception):
    pass


#: The app serving only the probes and metrics (see ``ExtenderSettings.probe_port``).
PROBES = web.AppKey("probes", web.Application)


def build_app(
    settings: ExtenderSettings,
    ledger: AdmissionLedger | None = None,
    binder: BindingClient | None = None,
) -> web.Application:
    """The aiohttp application; ``ledger`` may be passed in to share or inspect it, and
    ``binder`` replaces the in-cluster API client (None: built from the settings)."""
    if ledger is None:
        ledger = AdmissionLedger(settings.ledger_timeout_seconds)
    url = settings.api_server or in_cluster_url()
    cache = NodeCache(expect_objects=True) if settings.watch_nodes and url else None
    state = ExtenderState(ledger, node_cache=cache)
    metrics = ExtenderMetrics(
        lambda: len(state.ledger), lambda: len(state.pods), lambda: state.ledger.live_pods
    )
    if binder is None:
        binder = BindingClient(url, settings.token_file, settings.ca_file) if url else None
    verbs = _Verbs(settings, state, metrics, binder)
    feeds = _Feeds(settings, url, state)
    probes = _Probes(state, metrics)
    app = probes.routes(web.Application(client_max_size=settings.max_body_bytes))
    app[PROBES] = probes.routes(web.Application(client_max_size=1024))
    for verb, answer in (
        ("filter", verbs.filter),
        ("prioritize", verbs.prioritize),
        ("bind", verbs.bind),
    ):
        app.router.add_post(_route(settings.url_prefix, verb), verbs.handler(verb, answer))
    app.on_startup.append(feeds.start)
    app.on_cleanup.append(feeds.stop)
    app.on_cleanup.append(verbs.close)
    return app


class _Verbs:
    """The scheduler's three verbs over HTTP: each body read, answered by the pure
    verbs (``verbs.py``), counted and timed; the Binding written for ``bind``."""

    def __init__(
        self,
        settings: ExtenderSettings,
        state: ExtenderState,
        metrics: ExtenderMetrics,
        binder: BindingClient | None,
    ) -> None:
        self.max_body_bytes = settings.max_body_bytes
        self.policy = settings.policy
        self.state = state
        self.metrics = metrics
        self.binder = binder

    def handler(self, verb: str, answer: Callable[[Any], Awaitable[Any]]) -> Handler:
        """The request handler of ``verb``: a body it cannot use is a 400 (413 when too
        large), a bug a 500; it never ends the server."""
        metrics, limit = self.metrics, self.max_body_bytes

        async def handle(request: web.Request) -> web.Response:
            started = time.perf_counter()
            try:
                response = web.json_response(await answer(await _read_json(request)))
            except BadRequest as exc:
                log.warning("bad_request", verb=verb, reason=str(exc)[:300])
                response = _error(400, str(exc))
            except _TooLarge:
                log.warning("body_too_large", verb=verb, limit=limit)
                response = _error(413, f"the body is larger than {limit} bytes")
            except Exception as exc:  # a bug: logged and answered, the server goes on
                log.exception("request_failed", verb=verb)
                response = _error(500, f"internal error: {type(exc).__name__}")
            metrics.requests.labels(verb, str(response.status)).inc()
            metrics.latency.labels(verb).observe(time.perf_counter() - started)
            return response

        return handle

    async def filter(self, body: Any) -> Any:
        started = time.perf_counter()
        answer = filter_verb(body, self.policy, self.state)
        for reason, count in answer.pop(VERDICTS_KEY, {}).items():
            self.metrics.verdicts.labels(reason).inc(count)
        log.info(
            "filter",
            kept=len(answer["NodeNames"] or (answer["Nodes"] or {}).get("items") or ()),
            failed=len(answer["FailedNodes"]),
            holds=len(self.state.ledger),
            ms=round((time.perf_counter() - started) * 1000, 2),
        )
        return answer

    async def prioritize(self, body: Any) -> Any:
        return prioritize_verb(body, self.policy, self.state)

    async def bind(self, body: Any) -> Any:
        state, bindings = self.state, self.metrics.bindings
        try:
            args = bind_verb(body, self.policy, state)
        except BindRefused as exc:
            bindings.labels("refused").inc()
            log.info("bind_refused", reason=str(exc))
            return {"Error": str(exc)}
        if self.binder is None:
            state.ledger.forget_pod(args.uid)
            bindings.labels("failed").inc()
            return {"Error": "binding is not configured (no API server address)"}
        try:
            annotations = {}
            if args.plan:
                key = nodestate.plan_annotation_key(self.policy.resource_prefix)
                annotations[key] = nodestate.encode_plan(dict(args.plan))
            await self.binder.bind(args.namespace, args.name, args.uid, args.node, annotations)
        except BindError as exc:
            state.ledger.forget_pod(args.uid)
            bindings.labels("failed").inc()
            log.warning("bind_failed", pod=args.label, node=args.node, reason=str(exc))
            return {"Error": f"binding {args.label} to {args.node}: {exc}"}
        bindings.labels("bound").inc()
        log.info("bound", pod=args.label, node=args.node, holds=len(state.ledger))
        return {"Error": ""}

    async def close(self, _app: web.Application) -> None:
        if self.binder is not None:
            await self.binder.close()


class _Feeds:
    """What keeps the extender's view of the cluster current, started with the app:
    the Nodes and the node-state objects (with ``watch_nodes``), the pods (with
    ``watch_pods``; the start waits for their first list)."""

    def __init__(self, settings: ExtenderSettings, url: str, state: ExtenderState) -> None:
        self.settings = settings
        self.url = url
        self.state = state
        self.running: list[PodFeed | NodeFeed | StateFeed] = []

    async def start(self, _app: web.Application) -> None:
        if not self.url:
            return
        settings, state = self.settings, self.state
        prefix = settings.policy.resource_prefix
        endpoint = endpoint_of(self.url, settings.token_file, settings.ca_file)
        if state.node_cache is not None:
            nodes = NodeFeed(
                ApiClient(endpoint, metadata_only=True),
                prefix,
                state.node_cache,
                asyncio.get_running_loop(),
            )
            self.running.append(nodes)
            nodes.start()
            objects = StateFeed(
                ApiClient(endpoint),
                prefix,
                settings.state_namespace or stateobject.own_namespace(os.environ),
                state.node_cache,
                asyncio.get_running_loop(),
            )
            self.running.append(objects)
            objects.start()
        if not settings.watch_pods:
            return
        feed = PodFeed(
            ApiClient(endpoint),
            prefix,
            state.ledger,
            asyncio.get_running_loop(),
            on_first_list=settle_heap,  # also when the list outlasts the start's wait
        )
        self.running.append(feed)
        await feed.first_list()

    async def stop(self, _app: web.Application) -> None:
        loop = asyncio.get_running_loop()
        for feed in self.running:
            await loop.run_in_executor(None, feed.stop)


class _Probes:
    """``/healthz``, ``/readyz`` (the pods, and with a node cache the nodes, read once)
    and ``/metrics``, on the verbs' listener and on the probe listener."""

    def __init__(self, state: ExtenderState, metrics: ExtenderMetrics) -> None:
        self.state = state
        self.metrics = metrics

    def routes(self, target: web.Application) -> web.Application:
        target.router.add_get("/healthz", self.healthz)
        target.router.add_get("/readyz", self.readyz)
        target.router.add_get("/metrics", self.serve_metrics)
        return target

    async def healthz(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(self, _request: web.Request) -> web.Response:
        state = self.state
        if state.ledger.awaiting_list:
            return web.Response(text="the cluster's pods are not read yet\n", status=503)
        if state.node_cache is not None and not state.node_cache.listed:
            return web.Response(text="the cluster's nodes are not read yet\n", status=503)
        return web.Response(text="ok\n")

    async def serve_metrics(self, _request: web.Request) -> web.Response:
        data = generate_latest(self.metrics.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


#: The bounds of each extender listener (base/connguard.py): kube-scheduler keeps a few
#: connections alive; probes open one per check.
EXTENDER_LIMITS = ConnectionLimits(max_connections=128, max_per_peer=64, deadline=10.0)


class _GuardedSite(web.SockSite):
    """A ``SockSite`` whose connections go through a :class:`GuardedFactory`."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, factory: GuardedFactory):
        super().__init__(runner, sock)
        self._factory = factory

    async def start(self) -> None:
        await web.BaseSite.start(self)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._factory, sock=self._sock, backlog=128)


async def start(
    app: web.Application, address: str, port: int, guard: ConnectionGuard | None = None
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` under ``guard`` (default: :data:`EXTENDER_LIMITS`, issue 23 item 3);
    returns the runner (call ``cleanup()`` to stop) and the bound port."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(128)
    sock.setblocking(False)
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=30.0)
    holder: list[GuardedFactory] = []

    async def answered(request: web.Request, _response: web.StreamResponse) -> None:
        holder[0].answered(request.transport)

    app.on_response_prepare.append(answered)
    await runner.setup()
    assert runner.server is not None
    holder.append(GuardedFactory(runner.server, guard or ConnectionGuard(EXTENDER_LIMITS)))
    await _GuardedSite(runner, sock, holder[0]).start()
    return runner, int(sock.getsockname()[1])


def build_parser() -> argparse.ArgumentParser:
    defaults = ExtenderSettings()
    parser = Parser(
        prog="gpushare-scheduler-extender",
        description="kube-scheduler extender: keeps a node only if each GPU container of the "
        "pod fits on one healthy card, and scores nodes binpack or spread.",
    )
    parser.add_argument("--address", default=defaults.address, help="address to listen on")
    parser.add_argument(
        "--port", type=int, default=defaults.port, help="port to listen on (0: any free port)"
    )
    parser.add_argument(
        "--url-prefix",
        default=defaults.url_prefix,
        help="path before the verbs, the urlPrefix of KubeSchedulerConfiguration's extender",
    )
    parser.add_argument(
        "--resource-prefix", default=defaults.resource_prefix, help="prefix of the resources"
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default=defaults.placement,
        help="the daemon's placement (predicts its card) and the node scoring",
    )
    parser.add_argument(
        "--ledger-timeout-seconds",
        type=bounded_float(0.001, 3600),
        default=defaults.ledger_timeout_seconds,
        help="the longest a bound pod is counted on top of its node's annotation",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=defaults.max_body_bytes,
        help="largest request body accepted (413 above it)",
    )
    parser.add_argument(
        "--api-server",
        default=defaults.api_server,
        help="API server URL for the bind verb (default: the in-cluster address)",
    )
    parser.add_argument("--token-file", default=defaults.token_file, help="bearer token file")
    parser.add_argument(
        "--probe-port",
        type=int,
        default=defaults.probe_port,
        help="also serve /healthz, /readyz and /metrics (only) on this port (0: off)",
    )
    parser.add_argument(
        "--probe-address", default=defaults.probe_address, help="address of --probe-port"
    )
    parser.add_argument("--ca-file", default=defaults.ca_file, help="the API server's CA")
    parser.add_argument(
        "--watch-pods",
        action=argparse.BooleanOptionalAction,
        default=defaults.watch_pods,
        help="watch the cluster's pods so that room freed by a pod that ends is seen at "
        "once and pods bound by anyone are counted (needs list/watch on pods)",
    )
    parser.add_argument(
        "--watch-nodes",
        action=argparse.BooleanOptionalAction,
        default=defaults.watch_nodes,
        help="watch the cluster's Nodes and keep their cards, so that the scheduler can "
        "send node names only (nodeCacheCapable: true; needs list/watch on nodes)",
    )
    parser.add_argument(
        "--state-namespace",
        default=defaults.state_namespace,
        help="namespace of the daemons' state objects (ConfigMaps gpushare-node-<node>; "
        "needs list/watch on configmaps there); default: the extender's own (POD_NAMESPACE)",
    )
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="auto")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    add_version(parser)
    return parser


def parse_settings(argv: Sequence[str] | None) -> tuple[ExtenderSettings, argparse.Namespace]:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag, port in (("--port", args.port), ("--probe-port", args.probe_port)):
        if not 0 <= port <= 65535:
            parser.error(f"{flag} must be between 0 and 65535")
    if not 1024 <= args.max_body_bytes <= 1 << 30:
        parser.error("--max-body-bytes must be between 1024 and 1073741824")
    prefix = args.resource_prefix
    if not prefix or "/" in prefix or " " in prefix:
        parser.error(f"--resource-prefix {prefix!r} is not a domain name like gpushare.io")
    settings = ExtenderSettings(
        address=args.address,
        port=args.port,
        url_prefix=args.url_prefix,
        resource_prefix=prefix,
        placement=args.placement,
        ledger_timeout_seconds=args.ledger_timeout_seconds,
        max_body_bytes=args.max_body_bytes,
        api_server=args.api_server,
        token_file=args.token_file,
        ca_file=args.ca_file,
        probe_address=args.probe_address,
        probe_port=args.probe_port,
        watch_pods=args.watch_pods,
        watch_nodes=args.watch_nodes,
        state_namespace=args.state_namespace,
    )
    return settings, args


#: The collector's thresholds in the extender. It keeps millions of long-lived objects
#: (every node's cards, every GPU pod's facts, the verdicts); with the interpreter's
#: default (700, 10, 10) a filter that judges 500 nodes for a new pod shape ran ~70
#: young collections and often an old one that walked them all: at 5 000 nodes that
#: made the slowest of 30 such filters 191 ms against a median of 32 ms, and with
#: these 54 ms against 30 (``make scale``, docs/benchmarks.md). Garbage without cycles
#: is freed at once by reference counting whatever the thresholds.
GC_THRESHOLDS = (50_000, 50, 100)


def settle_heap() -> None:
    """Once the start's lists are read: what they built is never walked by the cycle
    collector again (``gc.freeze``); it is freed by reference counting as before."""
    gc.collect()
    gc.freeze()


async def _serve(settings: ExtenderSettings) -> None:
    gc.set_threshold(*GC_THRESHOLDS)
    app = build_app(settings)
    runners = []
    if settings.probe_port:
        probes, probe_port = await start(app[PROBES], settings.probe_address, settings.probe_port)
        runners.append(probes)
        log.info("probes_listening", address=settings.probe_address, port=probe_port)
    runner, port = await start(app, settings.address, settings.port)
    runners.append(runner)
    log.info(
        "listening",
        address=settings.address,
        port=port,
        filter=_route(settings.url_prefix, "filter"),
        prioritize=_route(settings.url_prefix, "prioritize"),
        bind=_route(settings.url_prefix, "bind"),
        placement=settings.placement,
        resource_prefix=settings.resource_prefix,
    )
    try:
        await asyncio.Event().wait()
    finally:
        for each in runners:
            await each.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    settings, args = parse_settings(argv)
    configure_logging(args.log_format, args.log_level)
    try:
        asyncio.run(_serve(settings))
    except KeyboardInterrupt:
        pass
    except OSError as exc:
        log.error("cannot_listen", address=settings.address, port=settings.port, error=str(exc))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
