"""Watching a collection the way client-go's reflector does: list, then watch from the
list's ``resourceVersion`` with bookmarks; the server ends each watch after a random 5
to 10 minutes and the next resumes from the last version seen; a 410 Gone (history
compacted) lists again; any other failure is retried after a doubling, jittered delay.

The daemon's pod watch (:mod:`gpushare.kube.podwatch`) and the scheduler extender's pod
feed (:mod:`gpushare.extender.podfeed`) both run on these pieces; what they list and
how they apply an event is their own.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from gpushare.kube.stdlibclient import ApiClient, ApiStatusError, Watch

log = structlog.get_logger(__name__)

#: The server ends each watch after a random time in this range (seconds), as client-go does.
WATCH_SECONDS = (300, 600)
#: A watch that sent nothing for this long past its own end is taken as dead.
READ_GRACE = 60.0


class Gone(Exception):
    """The watch's resourceVersion is too old: list again."""


def open_watch(api: ApiClient, path: str, query: Mapping[str, str], version: str) -> Watch:
    """A watch of ``path`` (``query``: its selectors) from ``version``, with bookmarks,
    ended by the server after a random time; :class:`Gone` when ``version`` is too old."""
    seconds = random.randint(*WATCH_SECONDS)
    asked = {
        **query,
        "resourceVersion": version,
        "allowWatchBookmarks": "true",
        "timeoutSeconds": str(seconds),
    }
    try:
        return api.watch(path, asked, read_timeout=seconds + READ_GRACE)
    except ApiStatusError as exc:
        if exc.status == 410:
            raise Gone() from None
        raise


def raise_if_error(kind: str, obj: Mapping[str, Any]) -> None:
    """An ``ERROR`` event ends the watch: :class:`Gone` for 410, else its status."""
    if kind == "ERROR":
        if obj.get("code") == 410:
            raise Gone()
        raise ApiStatusError(int(obj.get("code") or 500), str(obj.get("reason") or ""), "")


def run_until_stopped(
    stop: threading.Event,
    cycle: Callable[[], None],
    relist: Callable[[], None],
    max_backoff: float,
    **fields: Any,
) -> None:
    """Run ``cycle`` (list if needed, then one watch) until ``stop`` is set. After
    :class:`Gone`, ``relist`` (the next cycle lists again); after any other failure,
    wait a jittered delay that doubles up to ``max_backoff``. ``fields`` go on the
    log lines."""
    backoff = 1.0
    while not stop.is_set():
        try:
            cycle()
            backoff = 1.0
        except Gone:
            log.info("pod_watch_expired", **fields)
            relist()
        except Exception as exc:
            if stop.is_set():
                break
            log.warning("pod_watch_failed", error=str(exc)[:300], retry_seconds=backoff, **fields)
            if stop.wait(backoff * random.uniform(0.8, 1.2)):
                break
            backoff = min(backoff * 2, max_backoff)
