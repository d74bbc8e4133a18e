"""Install and uninstall gpushare on a cluster: the shipped manifests and node labels.

The manifests are ``daemonset/*.yaml``, shipped in the package as
``gpushare/manifests/`` (``make manifests`` copies them; a test fails when they
differ). Every object is applied with the label :data:`MANAGED_BY`, and only objects
carrying it are ever deleted: what an operator applied by ``kubectl apply -k`` or Helm
is left alone. The opt-in node label is read from the DaemonSet's nodeSelector, so it
cannot drift from the manifests.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any

import yaml

from gpushare.base.compat import zip_strict
from gpushare.config import Settings
from gpushare.gpu import mig
from gpushare.kube import nodestate, stateobject
from gpushare.kube.kubectlapi import ApiError, Cluster, describe
from gpushare.ops import hostcleanup, imageref

MANAGED_BY = {"app.kubernetes.io/managed-by": "kubectl-gpushare"}
#: Labels that NVIDIA's GPU feature discovery (or the GPU operator) puts on GPU nodes.
GPU_PRESENT_LABEL = "nvidia.com/gpu.present"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"

Say = Callable[[str], None]
#: How long ``uninstall`` waits for a daemon pod to leave a node it unlabelled.
UNINSTALL_WAIT_SECONDS = 60.0
#: How long ``uninstall`` waits for a node's host cleanup pod to report (an image import
#: on a cold node, a busy kubelet).
CLEANUP_WAIT_SECONDS = 180.0


class DeployError(Exception):
    """Install or uninstall cannot go on; the message is one line for the operator."""


def manifest_texts() -> dict[str, str]:
    """File name (``policies/`` ones with that prefix) -> text of every shipped
    manifest (the kustomization included)."""
    folder = resources.files("gpushare") / "manifests"
    texts = {}
    for prefix, where in (("", folder), ("policies/", folder / "policies")):
        if not where.is_dir():
            raise DeployError(
                f"this kubectl-gpushare lacks its manifests/{prefix} (a broken build); "
                "rebuild it with make kubectl-plugin or pip install the package"
            )
        for entry in where.iterdir():
            if entry.name.endswith(".yaml"):
                texts[prefix + entry.name] = entry.read_text()
    return texts


def load_objects() -> list[dict[str, Any]]:
    """The objects of the shipped kustomization, in its order."""
    texts = manifest_texts()
    kustomization = yaml.safe_load(texts["kustomization.yaml"])
    objects: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        objects.extend(doc for doc in yaml.safe_load_all(texts[name]) if doc)
    return objects


def opt_in_label(objects: Iterable[Mapping[str, Any]]) -> tuple[str, str]:
    """The (key, value) of the label that makes the DaemonSet run on a node."""
    for obj in objects:
        if obj.get("kind") == "DaemonSet":
            selector = obj["spec"]["template"]["spec"]["nodeSelector"]
            ((key, value),) = selector.items()
            return str(key), str(value)
    raise DeployError("the shipped manifests hold no DaemonSet")


def daemon_pod_selector(objects: Iterable[Mapping[str, Any]]) -> str:
    """A label selector for the DaemonSet's pods."""
    for obj in objects:
        if obj.get("kind") == "DaemonSet":
            labels = obj["spec"]["template"]["metadata"]["labels"]
            return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
    raise DeployError("the shipped manifests hold no DaemonSet")


def managed(obj: Mapping[str, Any]) -> dict[str, Any]:
    """``obj`` with the :data:`MANAGED_BY` label added."""
    result = copy.deepcopy(dict(obj))
    labels = result.setdefault("metadata", {}).setdefault("labels", {})
    labels.update(MANAGED_BY)
    return result


def is_ours(stored: Mapping[str, Any] | None) -> bool:
    labels = ((stored or {}).get("metadata") or {}).get("labels") or {}
    return all(labels.get(key) == value for key, value in MANAGED_BY.items())


def has_gpu(node: Mapping[str, Any]) -> bool:
    labels = (node.get("metadata") or {}).get("labels") or {}
    return labels.get(GPU_PRESENT_LABEL) == "true" or GPU_PRODUCT_LABEL in labels


def node_name(node: Mapping[str, Any]) -> str:
    return str((node.get("metadata") or {}).get("name"))


def gpu_nodes(cluster: Cluster) -> list[str]:
    """Names of the nodes that report an NVIDIA GPU, sorted."""
    return sorted(node_name(node) for node in cluster.nodes() if has_gpu(node))


def _pod_spec(daemonset: Mapping[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return spec


def customise(
    daemonset: Mapping[str, Any],
    stored: Mapping[str, Any] | None,
    image: str | None,
    runtime_class: str | None,
) -> dict[str, Any]:
    """The DaemonSet to apply: ``image`` and ``runtime_class`` when given, else what an
    earlier install set on the stored one (so that ``install --node`` of one more node
    never reverts them), else the shipped manifest's."""
    result = copy.deepcopy(dict(daemonset))
    pod = _pod_spec(result)
    before = _pod_spec(stored) if stored else {}
    if image is None and before.get("containers"):
        image = before["containers"][0].get("image")
    if image:
        pod["containers"][0]["image"] = image
    if runtime_class is None:
        runtime_class = before.get("runtimeClassName")
    if runtime_class:
        pod["runtimeClassName"] = runtime_class
    return result


def shipped_image(objects: Sequence[Mapping[str, Any]]) -> str:
    """The image reference the shipped DaemonSet names (``gpushare:<version>``)."""
    daemonset = next(obj for obj in objects if obj.get("kind") == "DaemonSet")
    return str(_pod_spec(daemonset)["containers"][0].get("image", ""))


def unbuilt_image_warning(shipped: str) -> str:
    """What ``install`` says when no ``--image`` was given and no earlier install set one."""
    name = shipped.rsplit("/", 1)[-1]
    return (
        f"warning: no --image given: the DaemonSet runs {shipped}, a reference no registry "
        f"serves; build and push the image (make image PUSH=1 IMAGE=<registry>/{name}) and "
        f"run install again with --image <registry>/{name}, or load {shipped} into every "
        "GPU node's container runtime"
    )


def install(
    cluster: Cluster,
    nodes: Sequence[str],
    say: Say,
    *,
    image: str | None = None,
    runtime_class: str | None = None,
    dry_run: bool = False,
) -> None:
    """Apply the manifests, then label ``nodes``. Idempotent; checks all before changing any.
    ``image`` and ``runtime_class`` replace the DaemonSet's (see :func:`customise`).
    ``dry_run``: the same checks, then say what would be done and change nothing."""
    if image is not None:
        problem = imageref.problem(image)
        if problem:
            raise DeployError(f"--image {image!r}: {problem}")
    objects = load_objects()
    label = opt_in_label(objects)
    found = {name: cluster.node(name) for name in nodes}
    missing = [name for name, node in found.items() if node is None]
    if missing:
        raise DeployError(f"no such node: {', '.join(missing)}")
    pairs = _to_apply(cluster, objects, say, image, runtime_class)
    _warn(pairs, objects, found, say, image)
    if dry_run:
        _say_what_would_be_done(pairs, found, label, say)
        return
    _apply_and_label(cluster, pairs, nodes, label, say)


if TYPE_CHECKING:  # an alias for annotations only: the kubectl plugin runs on Python 3.9
    #: An object to apply and what the cluster holds of it now (None: nothing).
    _Pair = tuple[dict[str, Any], dict[str, Any] | None]


def _to_apply(
    cluster: Cluster,
    objects: list[dict[str, Any]],
    say: Say,
    image: str | None,
    runtime_class: str | None,
) -> list[_Pair]:
    """The objects to apply (the policies only where served; the DaemonSet customised)
    with what is stored of each; a DeployError when one exists that is not ours."""
    objects = _served_policies(cluster, objects, say)
    stored = [cluster.read(obj) for obj in objects]
    pairs = list(zip_strict(objects, stored))
    foreign = [describe(obj) for obj, now in pairs if now is not None and not is_ours(now)]
    if foreign:
        raise DeployError(
            f"{', '.join(foreign)} already exist and were not created by kubectl-gpushare "
            "(kubectl apply -k or Helm?); leaving them alone"
        )
    return [
        (customise(obj, now, image, runtime_class) if obj.get("kind") == "DaemonSet" else obj, now)
        for obj, now in pairs
    ]


def _warn(
    pairs: list[_Pair],
    objects: list[dict[str, Any]],
    found: dict[str, dict[str, Any] | None],
    say: Say,
    image: str | None,
) -> None:
    """An image never built (the shipped name, no ``--image``); a node with no GPU."""
    for obj, _ in pairs:
        if obj.get("kind") == "DaemonSet" and image is None:
            shipped = shipped_image(objects)
            if _pod_spec(obj)["containers"][0].get("image") == shipped:
                say(unbuilt_image_warning(shipped))
    for name, node in found.items():
        if node is not None and not has_gpu(node):
            say(
                f"warning: node {name} reports no NVIDIA GPU (no {GPU_PRESENT_LABEL}=true or "
                f"{GPU_PRODUCT_LABEL} label): the daemon will run there and, without a GPU, "
                "offer nothing; uninstall --node to undo"
            )


def _say_what_would_be_done(
    pairs: list[_Pair],
    found: dict[str, dict[str, Any] | None],
    label: tuple[str, str],
    say: Say,
) -> None:
    key, value = label
    for obj, before in pairs:
        say(f"would {'create' if before is None else 'apply'} {describe(obj)}")
    for name, node in found.items():
        labels = ((node or {}).get("metadata") or {}).get("labels") or {}
        if labels.get(key) != value:
            say(f"would label node {name} {key}={value}")
        else:
            say(f"node {name} already labelled {key}={value}")
    say("dry run: nothing changed")


def _apply_and_label(
    cluster: Cluster,
    pairs: list[_Pair],
    nodes: Sequence[str],
    label: tuple[str, str],
    say: Say,
) -> None:
    key, value = label
    for obj, before in pairs:
        after = cluster.apply(managed(obj))
        version = (after.get("metadata") or {}).get("resourceVersion")
        if before is None:
            say(f"created {describe(obj)}")
        elif version == (before.get("metadata") or {}).get("resourceVersion"):
            say(f"unchanged {describe(obj)}")
        else:
            say(f"configured {describe(obj)}")
    for name in nodes:
        node = cluster.node(name) or {}
        labels = (node.get("metadata") or {}).get("labels") or {}
        if labels.get(key) == value:
            say(f"node {name} already labelled {key}={value}")
        else:
            cluster.patch_node_metadata(name, {key: value}, {})
            say(f"labelled node {name} {key}={value}")


#: The admission policies (daemonset/policies/): installed where the cluster serves them.
POLICY_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")


def _served_policies(
    cluster: Cluster, objects: list[dict[str, Any]], say: Say
) -> list[dict[str, Any]]:
    """``objects`` without the admission policies when the cluster does not serve them
    (before Kubernetes 1.30), saying loudly what that leaves open."""
    policies = [obj for obj in objects if obj.get("kind") in POLICY_KINDS]
    if not policies or cluster.serves(policies[0]):
        return objects
    names = sorted({str(obj["metadata"]["name"]) for obj in policies})
    say(
        "WARNING: this cluster does not serve admissionregistration.k8s.io/v1 "
        f"ValidatingAdmissionPolicy (Kubernetes 1.30 or later): {', '.join(names)} are NOT "
        "installed. The daemon's token may then patch every Node and Pod of the cluster "
        "and every ConfigMap of its namespace, and only the daemon refuses containers "
        "asking vcuda-core without vcuda-memory "
        "(docs/security.md). Upgrade the cluster and run install again."
    )
    return [obj for obj in objects if obj.get("kind") not in POLICY_KINDS]


@dataclass(frozen=True)
class UninstallPlan:
    """What :func:`uninstall` will do, decided before anything changes (shown to the
    operator, who may cancel: ``--dry-run`` stops here)."""

    #: Nodes asked about (named, or every opted-in node and those the daemon published on).
    targets: tuple[str, ...]
    #: Of those, the ones carrying the opt-in label (``key=value``).
    unlabel: tuple[str, ...]
    selector: str
    #: Nodes that keep the label: the objects stay while there is one.
    remaining: tuple[str, ...]
    #: ``describe()`` of the objects kubectl-gpushare created, deleted when none remains.
    delete: tuple[str, ...]
    #: ``describe()`` of objects of the same names it did not create: never touched.
    foreign: tuple[str, ...]

    def lines(self) -> list[str]:
        """One line per change, in the order :func:`uninstall` makes them."""
        out = [f"unlabel node {name} ({self.selector})" for name in self.unlabel]
        out += [
            f"remove what the daemon published on {name} (its gpu.* labels and annotation, "
            "its state object), "
            "once its pod has left"
            for name in self.targets
        ]
        out += [
            f"clean the host of {name} once its pod has left (a one-shot privileged pod: "
            "what no running GPU container holds)"
            for name in self.targets
        ]
        out += [f"delete {what}" for what in self.delete]
        out += [f"keep {what}: not created by kubectl-gpushare" for what in self.foreign]
        if self.remaining:
            out.append(f"keep the gpushare objects: still labelled: {', '.join(self.remaining)}")
        return out


def plan_uninstall(cluster: Cluster, nodes: Sequence[str]) -> UninstallPlan:
    """What uninstalling from ``nodes`` (all when empty) means now; changes nothing."""
    objects = load_objects()
    key, value = opt_in_label(objects)
    selector = f"{key}={value}"
    labelled = {node_name(node) for node in cluster.nodes(selector)}
    prefix = Settings().resource_prefix
    # Without names: every opted-in node, and those an earlier uninstall had to leave
    # the daemon's labels on (its pod was still there).
    published = {node_name(node) for node in cluster.nodes(nodestate.label_key(prefix, "count"))}
    unfinished = {
        node_name(node)
        for node in cluster.nodes()
        if hostcleanup.record_key(prefix) in ((node.get("metadata") or {}).get("annotations") or {})
    }
    targets = list(dict.fromkeys(nodes)) or sorted(labelled | published | unfinished)
    missing = [name for name in targets if name not in labelled and cluster.node(name) is None]
    if missing:
        raise DeployError(f"no such node: {', '.join(missing)}")
    remaining = tuple(sorted(labelled - set(targets)))
    delete: list[str] = []
    foreign: list[str] = []
    if not remaining:
        for obj in reversed(objects):
            stored = cluster.read(obj)
            if stored is not None:
                (delete if is_ours(stored) else foreign).append(describe(obj))
    return UninstallPlan(
        targets=tuple(targets),
        unlabel=tuple(name for name in targets if name in labelled),
        selector=selector,
        remaining=remaining,
        delete=tuple(delete),
        foreign=tuple(foreign),
    )


def uninstall(
    cluster: Cluster,
    nodes: Sequence[str] | UninstallPlan,
    say: Say,
    *,
    wait_seconds: float = UNINSTALL_WAIT_SECONDS,
    poll_seconds: float = 1.0,
    cleanup_seconds: float = CLEANUP_WAIT_SECONDS,
    image: str | None = None,
    clean_hosts: bool = True,
) -> bool:
    """Unlabel ``nodes`` (all labelled nodes when empty; or carry out a plan of
    :func:`plan_uninstall`); when none keeps the label, delete the objects
    kubectl-gpushare created, and only those. True when every host cleanup ran and removed
    all it meant to.

    What the daemon published on a node (its ``gpu.*`` labels and the per-card
    annotation) is removed once its pod has left the node, which it does soon after
    the opt-in label goes; a daemon still running could publish them again. Then, with
    ``clean_hosts``, the node's host is cleaned (``ops/hostcleanup.py``), by a pod of
    the installed DaemonSet's image (``image`` instead, where given).
    """
    plan = nodes if isinstance(nodes, UninstallPlan) else plan_uninstall(cluster, nodes)
    objects = load_objects()
    key, _ = opt_in_label(objects)
    prefix = Settings().resource_prefix
    template = hostcleanup.find_template(cluster, objects, image) if clean_hosts else None
    for name in plan.targets:
        if name in plan.unlabel:
            cluster.patch_node_metadata(name, {key: None}, {})
            say(f"unlabelled node {name}")
        else:
            say(f"node {name} was not labelled {plan.selector}")
    remaining = sorted(node_name(node) for node in cluster.nodes(plan.selector))
    if not remaining:
        _delete_ours(cluster, objects, say)
    waiting = _forget_published_state(
        cluster, objects, plan.targets, prefix, say, wait_seconds, poll_seconds
    )
    if remaining:
        say(f"kept the gpushare objects: still labelled: {', '.join(remaining)}")
    if not clean_hosts:
        return True
    gone = [name for name in plan.targets if name not in waiting]
    return _clean_hosts(cluster, objects, template, gone, image, say, cleanup_seconds, poll_seconds)


def _clean_hosts(
    cluster: Cluster,
    objects: Sequence[Mapping[str, Any]],
    template: hostcleanup.Template | None,
    nodes: Sequence[str],
    image: str | None,
    say: Say,
    wait_seconds: float,
    poll_seconds: float,
) -> bool:
    """Clean the hosts of ``nodes`` (their daemon has gone); True when each cleanup ran and
    removed all it meant to (what running containers hold is kept: that is no failure)."""
    prefix = Settings().resource_prefix
    ran = True
    for name in nodes:
        node = cluster.node(name)
        if node is None:
            continue
        chosen = template or hostcleanup.recorded(node, prefix, image)
        if chosen is None:
            shipped = image or shipped_image(objects)
            if image is None:
                say(
                    f"no gpushare DaemonSet and no earlier cleanup of {name}: its host is "
                    f"cleaned with {shipped} and the shipped paths (--image to name another)"
                )
            chosen = hostcleanup.shipped_template(objects, shipped)
        try:
            result = hostcleanup.clean_node(
                cluster, chosen, name, prefix, say, wait_seconds, poll_seconds
            )
        except ApiError as exc:
            say(f"host cleanup of {name} did not run: {exc}; run uninstall again")
            ran = False
            continue
        ran = ran and result.complete
    return ran


def _delete_ours(cluster: Cluster, objects: Sequence[Mapping[str, Any]], say: Say) -> None:
    for obj in reversed(objects):
        stored = cluster.read(obj)
        if stored is None:
            continue
        if not is_ours(stored):
            say(f"kept {describe(obj)}: not created by kubectl-gpushare")
            continue
        if cluster.delete(obj):
            say(f"deleted {describe(obj)}")


def _forget_published_state(
    cluster: Cluster,
    objects: Sequence[Mapping[str, Any]],
    nodes: Sequence[str],
    prefix: str,
    say: Say,
    wait_seconds: float,
    poll_seconds: float,
) -> set[str]:
    """Remove the daemon's labels and annotation from ``nodes``, and delete their state
    objects, once no gpushare pod runs there (waiting up to ``wait_seconds``); name the
    nodes where one still does."""
    try:
        waiting = _wait_for_daemon_pods(
            cluster, daemon_pod_selector(objects), nodes, say, wait_seconds, poll_seconds
        )
    except ApiError as exc:
        say(
            f"cannot tell whether the gpushare pods have gone ({exc}); the "
            f"{prefix}/gpu.* labels and annotation are left on {', '.join(nodes)}"
        )
        return set(nodes)
    for name in nodes:
        if name in waiting:
            say(
                f"the gpushare pod still runs on {name}: its {prefix}/gpu.* labels and "
                "annotation are left; run uninstall again once it has gone"
            )
            continue
        _forget_node(cluster, objects, name, prefix, say)
    return waiting


def _wait_for_daemon_pods(
    cluster: Cluster,
    selector: str,
    nodes: Sequence[str],
    say: Say,
    wait_seconds: float,
    poll_seconds: float,
) -> set[str]:
    """Of ``nodes``, those where a gpushare pod still runs after up to ``wait_seconds``."""

    def still_running(among: Sequence[str]) -> set[str]:
        hosts = {
            str((pod.get("spec") or {}).get("nodeName", ""))
            for pod in cluster.pods(label_selector=selector)
            if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
        }
        return hosts & set(among)

    waiting = still_running(nodes)
    deadline = time.monotonic() + wait_seconds
    if waiting:
        say(
            f"waiting up to {wait_seconds:g} s for the gpushare pod to leave "
            f"{', '.join(sorted(waiting))}"
        )
    while waiting and (left := deadline - time.monotonic()) > 0:
        time.sleep(min(poll_seconds, left))
        waiting = still_running(sorted(waiting))
    return waiting


def _forget_node(
    cluster: Cluster, objects: Sequence[Mapping[str, Any]], name: str, prefix: str, say: Say
) -> None:
    """Remove what the daemon published on node ``name``: its labels (the MIG ones too)
    and annotation, and its state object."""
    labels = dict.fromkeys(nodestate.label_keys(prefix))
    annotations = {nodestate.annotation_key(prefix): None}
    node = cluster.node(name) or {}
    meta = node.get("metadata") or {}
    present_labels = {k: v for k, v in labels.items() if k in (meta.get("labels") or {})}
    present_labels |= {k: None for k in meta.get("labels") or {} if mig.is_label(prefix, k)}
    present_annotations = {
        k: v for k, v in annotations.items() if k in (meta.get("annotations") or {})
    }
    if present_labels or present_annotations:
        cluster.patch_node_metadata(name, present_labels, present_annotations)
        say(f"removed what the daemon published on {name}")
    state = _state_object(objects, name)
    if state is not None and cluster.read(state) is not None and cluster.delete(state):
        say(f"deleted {describe(state)}")


def _state_object(objects: Sequence[Mapping[str, Any]], node: str) -> dict[str, Any] | None:
    """The node's state object (its owner, the Node, would take it along only when the
    Node is deleted), in the DaemonSet's namespace."""
    name = stateobject.object_name(node)
    spaces = [
        str(o["metadata"].get("namespace") or "") for o in objects if o.get("kind") == "DaemonSet"
    ]
    if not name or not spaces or not spaces[0]:
        return None
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": spaces[0]},
    }
