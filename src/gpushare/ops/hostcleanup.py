"""The host cleanup of ``kubectl gpushare uninstall``: a one-shot pod per node.

The daemon, stopped on a node that lost its opt-in label, can only empty what it owns:
it is unprivileged, so the cache tmpfs its init container mounted stays, and so do the
MPS and DRA directories, the DRA sockets and specs, and the host directory itself. Once
the daemon's pod has left a node, ``uninstall`` runs :func:`clean_node` there: a pod
made from the installed DaemonSet's own pod template (its image, the daemon container's
arguments, environment and hostPaths, so that it reads the same settings and sees the
same paths), running ``python -m gpushare.node.hostsweep`` privileged, with the hostPath
the init container mounts Bidirectionally mounted Bidirectionally too (the tmpfs is
unmounted in the host's mount namespace). It is pinned to the node (``nodeName``: no
scheduler), tolerates every taint, runs on the host network (it needs no network: a node
whose pod network is broken is cleaned all the same), has no service-account token and
no restart. Its report is its termination message (read from the pod's status: no log
access needed); the pod is deleted afterwards whatever happened.

What it must keep (a GPU container still runs) it keeps and says; the node then carries
the annotation :func:`record_key` (the cleanup pod's spec, so that a later run needs no
DaemonSet), and running ``kubectl gpushare uninstall`` again (``--node N`` or ``--all``)
after those containers end finishes the job and removes the annotation.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpushare.config import Settings
from gpushare.kube.kubectlapi import ApiError, Cluster
from gpushare.ops import verify  # the module: verify imports deploy, which imports this

Say = Callable[[str], None]
POD_LABEL = ("app.kubernetes.io/name", "gpushare-host-cleanup")
COMMAND = ["python", "-m", "gpushare.node.hostsweep"]
#: Where the cleanup pod mounts the parent of the host directory (to remove it: its own
#: mount of the host directory is a mount point, which cannot be removed).
PARENT_MOUNT = "/gpushare-host-lib-parent"
PARENT_VOLUME = "gpushare-host-lib-parent"
#: The hostsweep's exit status when the kubelet's PodResources could not be read.
EXIT_NO_RECORDS = 3


def record_key(prefix: str) -> str:
    """The Node annotation saying a host cleanup is unfinished there."""
    return f"{prefix}/host-cleanup"


def _env_value(container: Mapping[str, Any], name: str, default: str) -> str:
    for entry in container.get("env") or []:
        if entry.get("name") == name and "value" in entry:
            return str(entry["value"])
    return default


def _parent_volume(volumes: Sequence[Mapping[str, Any]], both: set[str]) -> dict[str, Any] | None:
    """A hostPath volume of the parent of the host directory (the hostPath mounted
    Bidirectionally), or None where there is none to tell it by."""
    for volume in volumes:
        path = str((volume.get("hostPath") or {}).get("path") or "").rstrip("/")
        if volume.get("name") in both and path.count("/") >= 2:
            parent = path.rsplit("/", 1)[0]
            return {"name": PARENT_VOLUME, "hostPath": {"path": parent, "type": "Directory"}}
    return None


def pod_spec(daemonset: Mapping[str, Any], image: str | None = None) -> dict[str, Any]:
    """The cleanup pod's spec (no node, no claims yet) from the DaemonSet's template."""
    template = daemonset["spec"]["template"]["spec"]
    main = template["containers"][0]
    both = {
        mount["name"]
        for init in template.get("initContainers") or []
        for mount in init.get("volumeMounts") or []
        if mount.get("mountPropagation") == "Bidirectional"
    }
    mounts = []
    for mount in main.get("volumeMounts") or []:
        mount = dict(mount)
        if mount["name"] in both:
            mount["mountPropagation"] = "Bidirectional"
        mounts.append(mount)
    used = {m["name"] for m in mounts}
    volumes = [copy.deepcopy(v) for v in template.get("volumes") or [] if v["name"] in used]
    args = ["--", *(main.get("args") or [])]
    parent = _parent_volume(volumes, both)
    if parent is not None:
        volumes.append(parent)
        mounts.append({"name": PARENT_VOLUME, "mountPath": PARENT_MOUNT})
        args = [f"--host-lib-parent={PARENT_MOUNT}", *args]
    container = _container(
        image or main["image"],
        main.get("imagePullPolicy", "IfNotPresent"),
        args,
        copy.deepcopy(main.get("env") or []),
        mounts,
    )
    if main.get("envFrom"):
        container["envFrom"] = copy.deepcopy(main["envFrom"])
    classes = {k: template[k] for k in ("priorityClassName", "runtimeClassName") if template.get(k)}
    return _spec(container, volumes, classes)


def _container(
    image: str, pull: str, args: list[str], env: list[Any], mounts: list[Any]
) -> dict[str, Any]:
    """The cleanup container: privileged, the cleanup command, its report as the
    termination message."""
    return {
        "name": "cleanup",
        "image": image,
        "imagePullPolicy": pull,
        "command": list(COMMAND),
        "args": args,
        "env": env,
        "volumeMounts": mounts,
        "securityContext": {"privileged": True},
        "terminationMessagePolicy": "File",
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
    }


def _spec(
    container: dict[str, Any], volumes: list[Any], classes: Mapping[str, str]
) -> dict[str, Any]:
    """The cleanup pod's spec around ``container``: no restart, the host network, no
    service-account token, every taint tolerated."""
    return {
        "restartPolicy": "Never",
        "hostNetwork": True,
        "automountServiceAccountToken": False,
        "tolerations": [{"operator": "Exists"}],
        "containers": [container],
        "volumes": volumes,
        **classes,
    }


@dataclass(frozen=True)
class Template:
    """Where and as what the cleanup pods run: the DaemonSet's namespace, the pod spec."""

    namespace: str
    spec: Mapping[str, Any]

    @property
    def driver(self) -> str:
        main = self.spec["containers"][0]
        return _env_value(main, "GPUSHARE_DRA_DRIVER", Settings().dra_driver)


def held_claims(cluster: Cluster, node: str, driver: str) -> list[str] | None:
    """UIDs of the ResourceClaims of ``driver`` allocated on ``node`` and reserved for a
    pod; None when they cannot be read (then the cleanup keeps every claim's files)."""
    try:
        claims = cluster.resource_claims()
    except ApiError:
        return None
    held = []
    for claim in claims or []:
        status = claim.get("status") or {}
        results = ((status.get("allocation") or {}).get("devices") or {}).get("results") or []
        ours = any(r.get("driver") == driver and r.get("pool") == node for r in results)
        if ours and status.get("reservedFor"):
            held.append(str(claim["metadata"]["uid"]))
    return sorted(held)


def node_pod(template: Template, node: str, claims: Sequence[str] | None) -> dict[str, Any]:
    """The cleanup pod of ``node``."""
    spec = copy.deepcopy(dict(template.spec))
    spec["nodeName"] = node
    container = spec["containers"][0]
    claim_args = ["--claims-unknown"] if claims is None else [f"--held-claims={','.join(claims)}"]
    container["args"] = [*claim_args, *container["args"]]
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"gpushare-host-cleanup-{digest}",
            "namespace": template.namespace,
            "labels": {POD_LABEL[0]: POD_LABEL[1], "app.kubernetes.io/part-of": "gpushare"},
        },
        "spec": spec,
    }


@dataclass
class Result:
    """One node's cleanup: whether it ran and reported, and its report (or why not)."""

    ran: bool
    report: dict[str, Any] = field(default_factory=dict)
    why: str = ""

    @property
    def complete(self) -> bool:
        """It ran, reported, and removed all it meant to (what it kept is held)."""
        return self.ran and not self.report.get("failed")

    @property
    def finished(self) -> bool:
        """Nothing of gpushare is left on the node."""
        return self.ran and not self.report.get("kept") and not self.report.get("failed")


def _terminated(pod: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        state = (status.get("state") or {}).get("terminated")
        if state:
            return dict(state)
    return None


def _stuck(cluster: Cluster, pod: Mapping[str, Any]) -> str:
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        reason = ((status.get("state") or {}).get("waiting") or {}).get("reason")
        if reason in verify.STUCK_REASONS:
            return str(reason)
    meta = pod.get("metadata") or {}
    uid = str(meta.get("uid") or "")
    if not uid:
        return ""
    events = cluster.events(str(meta.get("namespace")), f"involvedObject.uid={uid}")
    return verify.stuck_by_events(events) or ""


def _outcome(state: Mapping[str, Any]) -> Result:
    message = str(state.get("message") or "")
    try:
        report = json.loads(message)
    except ValueError:
        report = None
    if not isinstance(report, dict):
        return Result(False, why=f"exit {state.get('exitCode')}, no report: {message[:300]!r}")
    if report.get("error"):
        return Result(False, report, str(report["error"]))
    return Result(True, report)


def _wait(cluster: Cluster, pod: Mapping[str, Any], wait: float, poll: float) -> Result:
    deadline = time.monotonic() + wait
    while True:
        stored = cluster.read(pod)
        if stored is None:
            return Result(False, why="the pod was deleted by someone else")
        state = _terminated(stored)
        if state is not None:
            return _outcome(state)
        stuck = _stuck(cluster, stored)
        if stuck:
            return Result(False, why=f"the pod cannot run: {stuck}")
        left = deadline - time.monotonic()
        if left <= 0:
            phase = (stored.get("status") or {}).get("phase") or "Pending"
            return Result(False, why=f"the pod did not finish within {wait:g} s ({phase})")
        time.sleep(min(poll, left))


def _remove_pod(cluster: Cluster, pod: Mapping[str, Any], wait: float, poll: float) -> None:
    """Delete the pod and wait (up to ``wait``) for it to be gone."""
    try:
        cluster.delete(pod)
    except ApiError:
        return
    deadline = time.monotonic() + wait
    while cluster.read(pod) is not None and time.monotonic() < deadline:
        time.sleep(poll)


def run_pod(cluster: Cluster, pod: Mapping[str, Any], wait: float, poll: float) -> Result:
    """Create the cleanup pod, wait for its report, delete it."""
    if cluster.read(pod) is not None:  # one an interrupted run left behind
        _remove_pod(cluster, pod, wait, poll)
    try:
        cluster.create(pod)
    except ApiError as exc:
        return Result(False, why=f"the pod could not be created: {exc}")
    try:
        return _wait(cluster, pod, wait, poll)
    finally:
        _remove_pod(cluster, pod, wait, poll)


def find_template(
    cluster: Cluster, objects: Sequence[Mapping[str, Any]], image: str | None
) -> Template | None:
    """The cleanup pods' template from the DaemonSet as stored (the shipped one's name
    and namespace), whoever applied it; None when there is none."""
    for obj in objects:
        if obj.get("kind") == "DaemonSet":
            stored = cluster.read(obj)
            if stored is not None:
                return Template(str(stored["metadata"]["namespace"]), pod_spec(stored, image))
    return None


def shipped_template(objects: Sequence[Mapping[str, Any]], image: str) -> Template:
    """The template from the shipped DaemonSet (when the installed one is gone)."""
    daemonset = next(obj for obj in objects if obj.get("kind") == "DaemonSet")
    return Template(str(daemonset["metadata"]["namespace"]), pod_spec(daemonset, image))


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_PROPAGATION = frozenset({"Bidirectional", "HostToContainer", "None"})


def _strings(value: Any) -> list[str] | None:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        return None
    return list(value)


def _record_volumes(spec: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The recorded hostPath volumes, rebuilt (any other kind is dropped)."""
    volumes = []
    for volume in spec.get("volumes") or []:
        if not isinstance(volume, dict) or not isinstance(volume.get("hostPath"), dict):
            continue
        host, name = volume["hostPath"], volume.get("name")
        path, kind = host.get("path"), host.get("type", "")
        if isinstance(name, str) and isinstance(path, str) and path.startswith("/"):
            kind = kind if isinstance(kind, str) else ""
            volumes.append({"name": name, "hostPath": {"path": path, "type": kind}})
    return volumes


def _record_mounts(main: Mapping[str, Any], names: set[str]) -> list[dict[str, Any]]:
    mounts = []
    for mount in main.get("volumeMounts") or []:
        if not isinstance(mount, dict) or mount.get("name") not in names:
            continue
        path, propagation = mount.get("mountPath"), mount.get("mountPropagation", "None")
        if not isinstance(path, str) or not path.startswith("/"):
            continue
        rebuilt: dict[str, Any] = {"name": mount["name"], "mountPath": path}
        if propagation in _PROPAGATION and propagation != "None":
            rebuilt["mountPropagation"] = propagation
        if mount.get("readOnly") is True:
            rebuilt["readOnly"] = True
        mounts.append(rebuilt)
    return mounts


def _from_record(spec: Any) -> dict[str, Any] | None:
    """A recorded cleanup pod spec, rebuilt from what a cleanup pod may carry, or None.

    The record is a Node annotation: whoever can patch that Node (its kubelet, the
    daemon's own service account) can write it, and the operator's ``uninstall`` creates
    a privileged pod from it. So nothing is taken as written: the one container's image,
    the cleanup command (required as is), its string arguments, its environment's literal
    values and the pod's own fields (``fieldRef``), and hostPath volumes with their mounts
    are kept; everything else (a service account or its token, ``envFrom``, a Secret's or
    ConfigMap's value, secret or projected volumes, other containers, pull secrets,
    another node) is dropped, and the fixed fields of
    :func:`pod_spec` are set again (docs/security.md)."""
    containers = spec.get("containers") if isinstance(spec, dict) else None
    if not isinstance(containers, list) or len(containers) != 1:
        return None
    main = containers[0]
    if not isinstance(main, dict) or main.get("command") != COMMAND:
        return None
    args = _strings(main.get("args") or [])
    if args is None or not isinstance(main.get("image"), str):
        return None
    volumes = _record_volumes(spec)
    pull = main.get("imagePullPolicy")
    container = _container(
        main["image"],
        pull if pull in ("Always", "IfNotPresent", "Never") else "IfNotPresent",
        args,
        _record_env(main),
        _record_mounts(main, {v["name"] for v in volumes}),
    )
    classes = {
        key: spec[key]
        for key in ("priorityClassName", "runtimeClassName")
        if isinstance(spec.get(key), str) and _DNS_SUBDOMAIN.match(spec[key])
    }
    return _spec(container, volumes, classes)


def _record_env(main: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Literal values, and values of the pod's own fields (``fieldRef``); never a
    reference to a Secret or ConfigMap."""
    env: list[dict[str, Any]] = []
    for entry in main.get("env") or []:
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str):
            continue
        if isinstance(entry.get("value"), str):
            env.append({"name": name, "value": entry["value"]})
            continue
        field_ref = (entry.get("valueFrom") or {}).get("fieldRef")
        path = field_ref.get("fieldPath") if isinstance(field_ref, dict) else None
        if isinstance(path, str):
            env.append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}})
    return env


def recorded(
    node: Mapping[str, Any], prefix: str, image: str | None = None
) -> Template | None:
    """The template an earlier, unfinished run left on the Node, rebuilt from what a
    cleanup pod may carry (:func:`_from_record`), if readable; ``image`` replaces the
    recorded one."""
    annotations = (node.get("metadata") or {}).get("annotations") or {}
    try:
        data = json.loads(annotations.get(record_key(prefix)) or "")
        namespace, spec = data["namespace"], _from_record(data["spec"])
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if spec is None or not isinstance(namespace, str) or not _DNS_LABEL.match(namespace):
        return None
    if image:
        spec["containers"][0]["image"] = image
    return Template(namespace, spec)


def _say_result(node: str, result: Result, say: Say) -> None:
    if not result.ran:
        say(f"host cleanup of {node} did not finish: {result.why}; run uninstall again")
        return
    report = result.report
    unmounted = ", ".join(report.get("unmounted") or []) or "nothing"
    say(f"host cleanup of {node}: removed {report.get('removed', 0)} names, unmounted {unmounted}")
    for name, note in sorted((report.get("notes") or {}).items()):
        say(f"  on {node}: {name}: {note}")
    for kind in ("kept", "failed"):
        for name, why in sorted((report.get(kind) or {}).items()):
            say(f"  {kind} on {node}: {name}: {why}")
        if report.get(f"{kind}_not_shown"):
            say(f"  and {report[f'{kind}_not_shown']} more {kind} on {node}")
    if result.finished:
        say(f"nothing of gpushare is left on {node}'s host")
    elif report.get("failed"):
        say(f"{node}: not everything could be removed (above): run uninstall again")
    else:
        say(f"{node} keeps what running GPU containers hold: run uninstall again once they end")


def clean_node(
    cluster: Cluster,
    template: Template,
    node: str,
    prefix: str,
    say: Say,
    wait: float,
    poll: float,
) -> Result:
    """Run the cleanup pod on ``node``, say what it did, and record (or forget) on the
    Node that a cleanup is unfinished there."""
    claims = held_claims(cluster, node, template.driver)
    pod = node_pod(template, node, claims)
    say(f"cleaning the host of {node} (pod {template.namespace}/{pod['metadata']['name']}, "
        f"{template.spec['containers'][0]['image']})")  # fmt: skip
    result = run_pod(cluster, pod, wait, poll)
    _say_result(node, result, say)
    record = None
    if not result.finished:
        record = json.dumps({"namespace": template.namespace, "spec": template.spec})
    cluster.patch_node_metadata(node, {}, {record_key(prefix): record})
    return result


__all__ = [
    "POD_LABEL",
    "Result",
    "Template",
    "clean_node",
    "find_template",
    "held_claims",
    "node_pod",
    "pod_spec",
    "record_key",
    "recorded",
    "run_pod",
    "shipped_template",
]
