"""What a host cleanup after an uninstall removes outside the host directory.

``kubectl gpushare uninstall`` ends, on every node whose daemon has gone, with a one-shot
cleanup (``node/hostsweep.py``, run by ``ops/hostcleanup.py`` as a pod). Inside the host
directory :func:`gpushare.host.leftovers.plan` decides; this module decides, on names and
plain sets (no file system), about the other places the daemon writes:

* the kubelet's device-plugin directory: our sockets (``gpushare-*.sock``, the fresh
  names of a rolling update included) are removed: the daemon that served them is gone;
* the kubelet's ``plugins_registry/<driver>-reg.sock`` and ``plugins/<driver>/dra.sock``
  (the DRA driver's registration and service sockets): removed, and ``plugins/<driver>/``
  when nothing else is in it;
* every CDI directory the daemon writes (``--dra-cdi-dir``): a grant spec
  (``<prefix>-grant_<name>.json``) is kept while a listed container holds that grant, a
  claim spec (``<driver>-claim_<uid>.json``) while that claim is in use (all of them when
  that cannot be told), an unfinished write of ours (``.<spec>.<pid>.<tid>.tmp``) removed.

Names of others in these places (the kubelet's own ``kubelet.sock``, another plugin's
socket, another vendor's CDI spec) are never touched.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from gpushare.host.leftovers import Held, Plan, Seen, plan

#: the place keys of :class:`Places` (a CDI directory is keyed by its path)
DEVICE_PLUGINS = "device-plugins"
REGISTRY = "plugins_registry"
DRA_PLUGIN = "dra-plugin"
_SOCKET = re.compile(r"^gpushare-[A-Za-z0-9._-]+\.sock$")
DRA_SOCKET = "dra.sock"


@dataclass(frozen=True)
class Naming:
    """The names this install gives its files: the resource prefix (``gpushare.io``)
    and the DRA driver (``gpu.gpushare.io``)."""

    prefix: str
    driver: str

    @property
    def grant_spec(self) -> str:
        """The start of a grant spec's file name (``host/grantspecs.py``)."""
        return f"{self.prefix.replace('/', '-')}-grant_"

    @property
    def claim_spec(self) -> str:
        """The start of a claim spec's file name (``dra/claims.py``)."""
        return f"{self.driver}-claim_"

    @property
    def registry_socket(self) -> str:
        return f"{self.driver}-reg.sock"


@dataclass(frozen=True)
class Places:
    """The names found in each place outside the host directory (a place absent: no
    key)."""

    found: Mapping[str, frozenset[str]] = field(default_factory=dict)
    #: the CDI directories among the keys of ``found``
    cdi: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Sweep:
    """The host directory's plan, and outside it: (place, name) to remove, the places
    to remove as directories once emptied, and what is kept with why."""

    host: Plan
    remove: tuple[tuple[str, str], ...]
    rmdir: tuple[str, ...]
    keep: Mapping[str, str]


def _spec_kept(name: str, naming: Naming, held: Held) -> str | None:
    """Why a CDI spec file ``name`` stays; None: it goes; "": it is not ours."""
    if name.startswith(".") and name.endswith(".tmp"):
        inner = name[1:]
        ours = inner.startswith((naming.grant_spec, naming.claim_spec))
        return None if ours else ""
    if not name.endswith(".json"):
        return ""
    if name.startswith(naming.grant_spec):
        grant = name[len(naming.grant_spec) : -len(".json")]
        return "a running container holds this grant" if grant in held.grants else None
    if name.startswith(naming.claim_spec):
        uid = name[len(naming.claim_spec) : -len(".json")]
        if held.claim_uids is None:
            return "DRA claims in use cannot be told"
        return "its DRA claim is in use" if uid in held.claim_uids else None
    return ""


def _outside(
    places: Places, naming: Naming, held: Held
) -> tuple[list[tuple[str, str]], dict[str, str]]:
    remove: list[tuple[str, str]] = []
    keep: dict[str, str] = {}
    for name in sorted(places.found.get(DEVICE_PLUGINS, frozenset())):
        if _SOCKET.match(name):
            remove.append((DEVICE_PLUGINS, name))
    if naming.registry_socket in places.found.get(REGISTRY, frozenset()):
        remove.append((REGISTRY, naming.registry_socket))
    if DRA_SOCKET in places.found.get(DRA_PLUGIN, frozenset()):
        remove.append((DRA_PLUGIN, DRA_SOCKET))
    for directory in sorted(places.cdi):
        for name in sorted(places.found.get(directory, frozenset())):
            why = _spec_kept(name, naming, held)
            if why is None:
                remove.append((directory, name))
            elif why:
                keep[f"{directory}/{name}"] = why
    return remove, keep


def sweep(seen: Seen, places: Places, naming: Naming, held: Held) -> Sweep:
    """Everything of gpushare on the node that no running container can use."""
    remove, keep = _outside(places, naming, held)
    rmdir: list[str] = []
    if DRA_PLUGIN in places.found and places.found[DRA_PLUGIN] <= {DRA_SOCKET}:
        rmdir.append(DRA_PLUGIN)
    return Sweep(plan(seen, held), tuple(remove), tuple(rmdir), keep)


__all__ = [
    "DEVICE_PLUGINS",
    "DRA_PLUGIN",
    "DRA_SOCKET",
    "REGISTRY",
    "Naming",
    "Places",
    "Sweep",
    "sweep",
]
