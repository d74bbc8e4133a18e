"""Watching a collection the way client-go's reflector does: list, then watch from the
list's ``resourceVersion`` with bookmarks; the server ends each watch after a random 5
to 10 minutes and the next resumes from the last version seen; a 410 Gone (history
compacted) lists again; any other failure is retried after a doubling, jittered delay.
A cycle (a list if needed, then one watch) that the server ends sooner than
:data:`QUICK_CYCLE_SECONDS` (410 at once, a watch ended at once; not a watch the
caller's own list superseded) is followed by a doubling, jittered pause too (from
:data:`FIRST_PAUSE` up to the caller's maximum), reset by the first cycle that lasts:
a server answering every watch at once costs at most a few requests a second at
first, then one per maximum back-off,
never a busy loop of watches and full lists.

The daemon's pod watch (:mod:`gpushare.kube.podwatch`) and the scheduler extender's pod
feed (:mod:`gpushare.extender.podfeed`) both run on these pieces; what they list and
how they apply an event is their own.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog

from gpushare.kube.stdlibclient import ApiClient, ApiStatusError, Watch

log = structlog.get_logger(__name__)

#: The server ends each watch after a random time in this range (seconds), as client-go does.
WATCH_SECONDS = (300, 600)
#: A watch that sent nothing for this long past its own end is taken as dead.
READ_GRACE = 60.0
#: A cycle (list if needed, then one watch) ending sooner than this ended "at once".
QUICK_CYCLE_SECONDS = 1.0
#: The first pause after a cycle that ended at once (then doubled, to the maximum).
FIRST_PAUSE = 0.5


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
    cycle: Callable[[], bool | None],
    relist: Callable[[], None],
    max_backoff: float,
    **fields: Any,
) -> None:
    """Run ``cycle`` (list if needed, then one watch) until ``stop`` is set. After
    :class:`Gone`, ``relist`` (the next cycle lists again); after any other failure,
    wait a jittered delay that doubles up to ``max_backoff``. A cycle that the server
    ends (or answers Gone) sooner than :data:`QUICK_CYCLE_SECONDS` is followed by a
    pause that doubles from :data:`FIRST_PAUSE` up to ``max_backoff`` while cycles keep
    ending at once; a cycle that returns True ended for a reason of the caller's (a
    list of its own superseded the watch) and is resumed at once. ``fields`` go on the
    log lines."""
    backoff = 1.0
    pause = 0.0
    while not stop.is_set():
        began = time.monotonic()
        try:
            superseded = cycle()
            backoff = 1.0
            if superseded:
                continue
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
            continue
        if time.monotonic() - began >= QUICK_CYCLE_SECONDS:
            pause = 0.0
            continue
        pause = min(max(pause * 2, FIRST_PAUSE), max_backoff)
        if pause >= max_backoff or pause == FIRST_PAUSE:  # once at each end of the range
            log.info("pod_watch_ended_at_once", pause_seconds=pause, **fields)
        if stop.wait(pause * random.uniform(0.8, 1.2)):
            break
