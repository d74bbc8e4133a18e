"""At start, remove the device-plugin sockets that earlier daemon instances left behind.

A daemon stopped by SIGTERM removes its own sockets; one killed with ``kill -9`` or by the
OOM killer cannot, and since every instance serves on names of its own
(:mod:`gpushare.deviceplugin.socketnames`), nobody would ever bind those names again: they
would pile up in the kubelet's directory, one set per crash. A starting daemon removes the
ones that are gpushare's by name (:func:`socketnames.leftover_candidates`) and that no
process listens on (a ``connect(2)`` refused: :func:`kubeletgrpc.remove_if_unserved`);
a socket that answers is another live instance's (the old daemon of a ``maxSurge`` update)
and is left alone, as is anything that is not a socket, a link, or a dot file.
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog

from gpushare.base.kubeletgrpc import remove_if_unserved
from gpushare.deviceplugin.socketnames import leftover_candidates

log = structlog.get_logger(__name__)


def remove_stale_sockets(directory: Path, token: str) -> list[str]:
    """Remove gpushare's unserved sockets in ``directory`` (not this instance's, named by
    ``token``); one ``stale_plugin_socket_removed`` event each. The names removed."""
    try:
        names = os.listdir(directory)
    except OSError as exc:
        log.warning("stale_plugin_sockets_unreadable", directory=str(directory), error=str(exc))
        return []
    removed = []
    for name in leftover_candidates(names, token):
        if remove_if_unserved(directory / name):
            log.info("stale_plugin_socket_removed", socket=str(directory / name))
            removed.append(name)
    return removed
