"""What the daemon keeps of a pod: the few fields it reads, nothing else.

The pod watch sees every pod bound to the node, and a tenant writes those objects: up
to 1.5 MiB each (long environment lists, large annotations), with terminal pods kept by
PodGC long after they end. The daemon reads only: the UID, namespace, name,
``resourceVersion`` and ``deletionTimestamp``; the card-choice annotations
(``gputype.NAMES`` under ``<prefix>/`` and ``nvidia.com/``) and the scheduler extender's
plan (``<prefix>/plan``), values cut at :data:`MAX_ANNOTATION_CHARS`; the phase; and,
per init and app container in spec order, its name, ``restartPolicy`` and the
``<prefix>/`` quantities of its limits and requests, and of a GPU container the settings
that could change its limits (``share/reserved.py``: reserved ``env`` names without their
values, unsafe ``envFrom`` prefixes, reserved mount paths; at most
:data:`MAX_RESERVED` of each). :func:`slim` keeps exactly that,
and drops a pod at once (None) when it is terminal or none of its containers asks for a
``<prefix>/`` resource, so the memory a pod costs the daemon is bounded whatever its
object holds (docs/security.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpushare.base.quantity import whole_units
from gpushare.kube.nodestate import plan_annotation_key
from gpushare.kube.podspecs import TERMINAL_PHASES
from gpushare.share.gputype import NAMES, OTHER_PREFIX
from gpushare.share.reserved import env_reserved, path_reserved, prefix_can_form_reserved

#: A card-choice annotation is a short comma list; a longer value is cut.
MAX_ANNOTATION_CHARS = 4096
#: Names and quantities are short in valid objects; anything longer is cut.
MAX_FIELD_CHARS = 253
PATH_MAX = 4096
#: At most this many containers of a pod are kept (the API server allows no more
#: than a few hundred in 1.5 MiB; a pod past this is not one the daemon serves).
MAX_CONTAINERS = 256
#: Of a GPU container's settings that could change its limits, this many of each are
#: kept: enough to say why it is refused.
MAX_RESERVED = 4


def _text(value: Any, limit: int = MAX_FIELD_CHARS) -> str:
    return str(value)[:limit] if value is not None else ""


def _quantities(section: Any, prefix: str) -> dict[str, str]:
    if not isinstance(section, Mapping):
        return {}
    mine = f"{prefix}/"
    return {
        _text(name): _text(value)
        for name, value in section.items()
        if isinstance(name, str) and name.startswith(mine)
    }


def _positive(value: str) -> bool:
    return (whole_units(value) or 0) > 0


def _container(container: Any, prefix: str) -> dict[str, Any] | None:
    if not isinstance(container, Mapping):
        return None
    resources = container.get("resources")
    resources = resources if isinstance(resources, Mapping) else {}
    limits = _quantities(resources.get("limits"), prefix)
    requests = _quantities(resources.get("requests"), prefix)
    kept: dict[str, Any] = {"name": _text(container.get("name"))}
    if container.get("restartPolicy") is not None:
        kept["restartPolicy"] = _text(container.get("restartPolicy"))
    if limits or requests:
        kept["resources"] = {"limits": limits, "requests": requests}
        kept.update(_reserved_settings(container))
    return kept


def _entries(value: Any) -> list[Mapping[str, Any]]:
    return [v for v in value if isinstance(v, Mapping)] if isinstance(value, list) else []


def _reserved_settings(container: Mapping[str, Any]) -> dict[str, Any]:
    """What ``share/reserved.tampering`` reads, only the entries that make it speak."""
    env = [
        {"name": _text(e.get("name"))}
        for e in _entries(container.get("env"))
        if env_reserved(str(e.get("name", "")))
    ][:MAX_RESERVED]
    sources = [
        {"prefix": _text(f.get("prefix") or "")}
        for f in _entries(container.get("envFrom"))
        if prefix_can_form_reserved(str(f.get("prefix") or ""))
    ][:MAX_RESERVED]
    mounts = [
        {"mountPath": _text(m.get("mountPath"), PATH_MAX)}
        for m in _entries(container.get("volumeMounts"))
        if path_reserved(str(m.get("mountPath", ""))[:PATH_MAX])
    ][:MAX_RESERVED]
    kept: dict[str, Any] = {}
    for key, found in (("env", env), ("envFrom", sources), ("volumeMounts", mounts)):
        if found:
            kept[key] = found
    return kept


def asks_for_gpus(pod: Mapping[str, Any]) -> bool:
    """Whether a slimmed pod has a container asking a positive ``<prefix>/`` quantity."""
    spec = pod.get("spec") or {}
    return any(
        _positive(value)
        for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
        for section in ((container.get("resources") or {}).values())
        for value in section.values()
    )


def slim(pod: Mapping[str, Any], prefix: str) -> dict[str, Any] | None:
    """The part of ``pod`` the daemon keeps; None for a terminal pod or one that asks
    for no ``<prefix>/`` resource (it is dropped at once, and removed if known)."""
    status = pod.get("status")
    phase = _text((status if isinstance(status, Mapping) else {}).get("phase") or "Pending")
    if phase in TERMINAL_PHASES:
        return None
    spec = pod.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    kept_spec: dict[str, list[dict[str, Any]]] = {}
    for field in ("initContainers", "containers"):
        containers = spec.get(field)
        if isinstance(containers, list):
            kept = [_container(c, prefix) for c in containers[:MAX_CONTAINERS]]
            kept_spec[field] = [c for c in kept if c is not None]
    meta = pod.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    annotations = meta.get("annotations")
    annotations = annotations if isinstance(annotations, Mapping) else {}
    wanted = {f"{domain}/{name}" for domain in (prefix, OTHER_PREFIX) for name in NAMES}
    wanted.add(plan_annotation_key(prefix))  # the scheduler extender's plan
    kept_meta: dict[str, Any] = {
        key: _text(meta.get(key))
        for key in ("uid", "namespace", "name", "resourceVersion")
        if meta.get(key) is not None
    }
    if meta.get("deletionTimestamp"):
        kept_meta["deletionTimestamp"] = _text(meta.get("deletionTimestamp"))
    choice = {
        key: _text(value, MAX_ANNOTATION_CHARS)
        for key, value in annotations.items()
        if key in wanted and isinstance(value, str)
    }
    if choice:
        kept_meta["annotations"] = choice
    result = {"metadata": kept_meta, "spec": kept_spec, "status": {"phase": phase}}
    return result if asks_for_gpus(result) else None


#: Of a pod that uses ResourceClaims, at most this many entries are kept in all (pod
#: claims, claim statuses, containers' claim references, extended-resource mappings; a
#: valid pod has at most 32 pod claims, and real ones a handful of references): a pod
#: with more is not kept at all (its reader asks the API server), so that a tenant's
#: pods cost the daemon at most about 80 KiB each (names of the longest valid length), whatever
#: they hold (110 such pods, a node's default, about 9 MiB).
MAX_CLAIM_ENTRIES = 128


class _NotKept(Exception):
    """The pod is past a bound, or holds a value the API server would not send."""


def _named(
    entries: Any, fields: tuple[str, ...], most: int = MAX_CLAIM_ENTRIES
) -> list[dict[str, Any]]:
    """Of each mapping in ``entries`` (other items are no entries), ``fields`` as they
    are: absent or null ones left out; :class:`_NotKept` beyond ``most`` entries or for a
    field that is not a string of at most :data:`MAX_FIELD_CHARS`, so that what is kept
    is read exactly as the whole object would be, or not kept at all."""
    found = _entries(entries)
    if len(found) > most:
        raise _NotKept
    kept = []
    for entry in found:
        values = {f: entry.get(f) for f in fields if entry.get(f) is not None}
        if not all(isinstance(v, str) and len(v) <= MAX_FIELD_CHARS for v in values.values()):
            raise _NotKept
        kept.append(values)
    return kept


def claim_view(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    """The part of ``pod`` that says which ResourceClaims its containers use (what the
    DRA driver reads of a pod that reserves a claim, ``dra/mates.py``): UID, namespace,
    name, ``spec.resourceClaims``, each container's name and ``resources.claims``,
    ``status.resourceClaimStatuses`` and ``status.extendedResourceClaimStatus``, whole.
    None for a terminal pod, for one whose spec names no claim and no extended
    resource's claim, and for one past the bounds (:data:`MAX_POD_CLAIMS`,
    :data:`MAX_CONTAINERS`) or holding a value no API server sends: never a part of it."""
    spec = pod.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    status = pod.get("status")
    status = status if isinstance(status, Mapping) else {}
    phase = _text(status.get("phase") or "Pending")
    extended = status.get("extendedResourceClaimStatus")
    if phase in TERMINAL_PHASES or not (spec.get("resourceClaims") or extended):
        return None
    meta = pod.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    try:
        kept_spec: dict[str, Any] = {
            "resourceClaims": _named(
                spec.get("resourceClaims"),
                ("name", "resourceClaimName", "resourceClaimTemplateName"),
            )
        }
        for field in ("initContainers", "containers"):
            # a container that names no claim uses none (an extended resource's claim
            # names its containers itself)
            users = [_claims_of(c) for c in _entries(spec.get(field))]
            kept_spec[field] = [c for c in users if c["resources"]["claims"]]
        kept_status: dict[str, Any] = {
            "phase": phase,
            "resourceClaimStatuses": _named(
                status.get("resourceClaimStatuses"), ("name", "resourceClaimName")
            ),
        }
        if isinstance(extended, Mapping):
            kept_status["extendedResourceClaimStatus"] = {
                **_named([extended], ("resourceClaimName",), 1)[0],
                "requestMappings": _named(extended.get("requestMappings"), ("containerName",)),
            }
    except _NotKept:
        return None
    if _entry_count(kept_spec, kept_status) > MAX_CLAIM_ENTRIES:
        return None
    kept_meta = {key: _text(meta.get(key)) for key in ("uid", "namespace", "name")}
    return {"metadata": kept_meta, "spec": kept_spec, "status": kept_status}


def _entry_count(spec: Mapping[str, Any], status: Mapping[str, Any]) -> int:
    containers = [*spec["initContainers"], *spec["containers"]]
    extended = status.get("extendedResourceClaimStatus") or {}
    return (
        len(spec["resourceClaims"])
        + len(status["resourceClaimStatuses"])
        + sum(len(c["resources"]["claims"]) for c in containers)
        + len(extended.get("requestMappings") or ())
    )


def _claims_of(container: Mapping[str, Any]) -> dict[str, Any]:
    resources = container.get("resources")
    claims = resources.get("claims") if isinstance(resources, Mapping) else None
    return {
        **_named([container], ("name",), 1)[0],
        "resources": {"claims": _named(claims, ("name",))},
    }
