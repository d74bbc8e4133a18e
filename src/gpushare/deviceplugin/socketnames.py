"""Which socket names in the kubelet's device-plugin directory are a daemon instance's own,
and which are gpushare's at all (pure: names in, names out).

Every daemon instance draws a token at start and serves every resource on names that carry
it: ``gpushare-vcuda-memory.<token>.sock`` first, ``gpushare-vcuda-memory.<token>-<n>.sock``
for each renewal (:mod:`gpushare.deviceplugin.registration`). Two daemons of one node (a
``maxSurge`` rolling update) therefore never bind, rename over or remove each other's
sockets, and a 1.37 kubelet, which keys device-plugin endpoints by socket path
(kubernetes#135437), holds one endpoint per instance: the new one registers beside the old.

The resource's own part of the name (``gpushare-vcuda-memory.sock``, ``gpushare-gpu.sock``,
``gpushare-mig-1g.5gb.sock``: :attr:`Resource.socket_name`, ``ExclusiveResource.socket_name``,
``migserve.socket_name``) is the *base* name; no instance serves on it.

A daemon killed with ``kill -9`` (or by the OOM killer) leaves its sockets behind, and with
names of its own nobody ever binds them again: :func:`ours` says which names a starting
daemon may consider its kind's leftovers (the host side, ``stalesockets``, removes only
those no process listens on).
"""

from __future__ import annotations

import secrets

#: Every socket name of gpushare's device plugin starts so...
PREFIX = "gpushare-"
#: ... and ends so.
SUFFIX = ".sock"
#: Hex digits of an instance's token (two daemons of a node collide 1 in 16.7 million).
TOKEN_BYTES = 3


def draw_token() -> str:
    """A daemon instance's token: six hex digits."""
    return secrets.token_hex(TOKEN_BYTES)


def _stem(base_name: str) -> str:
    if not ours(base_name):
        raise ValueError(f"{base_name!r} is not a gpushare socket name")
    return base_name.removesuffix(SUFFIX)


def instance_name(base_name: str, token: str) -> str:
    """The name an instance first serves a resource on: ``<stem>.<token>.sock``."""
    return f"{_stem(base_name)}.{token}{SUFFIX}"


def renewal_name(base_name: str, token: str, n: int) -> str:
    """The instance's ``n``-th fresh name for a resource (n >= 1): ``<stem>.<token>-<n>.sock``."""
    if n < 1:
        raise ValueError("renewals count from 1")
    return f"{_stem(base_name)}.{token}-{n}{SUFFIX}"


def ours(name: str) -> bool:
    """A name gpushare's device plugin serves on (any instance, any release: the base names
    of releases before per-instance names too): ``gpushare-*.sock``, one path component,
    never a dot file (an instance binds hidden, as ``.<name>.<pid>-<id>``, and renames into
    place; the kubelet's watcher skips dot files)."""
    return (
        name.startswith(PREFIX)
        and name.endswith(SUFFIX)
        and len(name) > len(PREFIX) + len(SUFFIX)
        and "/" not in name
        and "\0" not in name
    )


def leftover_candidates(names: list[str], token: str) -> list[str]:
    """Of a directory's entry names, those a starting instance with ``token`` may probe as
    leftovers of another instance: gpushare's, not its own (sorted)."""
    own = f".{token}"
    return sorted(
        name
        for name in names
        if ours(name) and not name.removesuffix(SUFFIX).endswith(own) and f"{own}-" not in name
    )
