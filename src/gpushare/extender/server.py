"""``gpushare-scheduler-extender``: the filter and prioritize verbs over HTTP (aiohttp).

The HTTP layer only reads the body, calls the pure verbs (``verbs.py``) and answers.
A body it cannot use gets HTTP 400 with a message; anything unexpected is logged and
answered with 500. It never exits because of a request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from gpushare.cli import Parser, add_version, bounded_float
from gpushare.config import LOG_FORMATS, LOG_LEVELS
from gpushare.extender.fit import PLACEMENTS
from gpushare.extender.ledger import AdmissionLedger
from gpushare.extender.verbs import BadRequest, ExtenderPolicy, filter_verb, prioritize_verb
from gpushare.logs import configure_logging

log = structlog.get_logger(__name__)

#: A NodeList of a few thousand full Node objects can run to tens of MiB.
MAX_BODY_BYTES = 256 << 20

DEFAULT_PORT = 9446
DEFAULT_LEDGER_TIMEOUT = 60.0


@dataclass(frozen=True)
class ExtenderSettings:
    address: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    url_prefix: str = "/gpushare"
    resource_prefix: str = "gpushare.io"
    placement: str = "binpack"
    ledger_timeout_seconds: float = DEFAULT_LEDGER_TIMEOUT

    @property
    def policy(self) -> ExtenderPolicy:
        return ExtenderPolicy(self.resource_prefix, self.placement)


def _route(prefix: str, verb: str) -> str:
    return "/" + "/".join(part for part in (prefix.strip("/"), verb) if part)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _never_crash(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as exc:
        log.exception("request_failed", path=request.path)
        return web.json_response({"Error": f"internal error: {type(exc).__name__}"}, status=500)


async def _read_json(request: web.Request) -> Any:
    try:
        text = await request.text()
    except web.HTTPRequestEntityTooLarge:
        raise
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(f"the body is not UTF-8 text: {exc}") from None
    if not text.strip():
        raise BadRequest("the body is empty; expected ExtenderArgs JSON")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRequest(f"the body is not JSON: {exc}") from None


def _bad_request(verb: str, exc: BadRequest) -> web.Response:
    log.warning("bad_request", verb=verb, reason=str(exc))
    return web.json_response({"Error": str(exc)}, status=400)


def build_app(settings: ExtenderSettings, ledger: AdmissionLedger | None = None) -> web.Application:
    """The aiohttp application; ``ledger`` may be passed in to share or inspect it."""
    if ledger is None:
        ledger = AdmissionLedger(settings.ledger_timeout_seconds)
    policy = settings.policy

    async def filter_handler(request: web.Request) -> web.Response:
        started = time.perf_counter()
        try:
            answer = filter_verb(await _read_json(request), policy, ledger)
        except BadRequest as exc:
            return _bad_request("filter", exc)
        log.info(
            "filter",
            kept=[n["metadata"]["name"] for n in answer["Nodes"]["items"]],
            failed=answer["FailedNodes"],
            pending=len(ledger),
            ms=round((time.perf_counter() - started) * 1000, 2),
        )
        return web.json_response(answer)

    async def prioritize_handler(request: web.Request) -> web.Response:
        try:
            answer = prioritize_verb(await _read_json(request), policy, ledger)
        except BadRequest as exc:
            return _bad_request("prioritize", exc)
        log.debug("prioritize", scores={s["Host"]: s["Score"] for s in answer})
        return web.json_response(answer)

    async def healthz(_request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    app = web.Application(middlewares=[_never_crash], client_max_size=MAX_BODY_BYTES)
    app.router.add_post(_route(settings.url_prefix, "filter"), filter_handler)
    app.router.add_post(_route(settings.url_prefix, "prioritize"), prioritize_handler)
    app.router.add_get("/healthz", healthz)
    return app


async def start(app: web.Application, address: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve ``app``; returns the runner (call ``cleanup()`` to stop) and the bound port."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(128)
    sock.setblocking(False)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
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
        help="the longest a pod let through is counted on top of its node's annotation",
    )
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="auto")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info")
    add_version(parser)
    return parser


def parse_settings(argv: Sequence[str] | None) -> tuple[ExtenderSettings, argparse.Namespace]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error("--port must be between 0 and 65535")
    if args.ledger_timeout_seconds <= 0:
        parser.error("--ledger-timeout-seconds must be greater than 0")
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
    )
    return settings, args


async def _serve(settings: ExtenderSettings) -> None:
    runner, port = await start(build_app(settings), settings.address, settings.port)
    log.info(
        "listening",
        address=settings.address,
        port=port,
        filter=_route(settings.url_prefix, "filter"),
        prioritize=_route(settings.url_prefix, "prioritize"),
        placement=settings.placement,
        resource_prefix=settings.resource_prefix,
    )
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


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
