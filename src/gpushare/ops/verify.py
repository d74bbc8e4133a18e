"""``kubectl gpushare verify --node NAME``: prove on a node that limits are enforced.

Under each memory backend the node offers for shares (its Node annotation says which
card has which, ``docs/choosing.md``; ``--backend`` picks one), it creates one
short-lived pod running the gpushare image's enforcement probe
(:mod:`gpushare.probe.checks`) in the container the kubelet and the daemon set up:
``interposer``: on the node (``spec.nodeName``: no scheduler involved) asking for a small
share (by default 4 memory units and 30 core units); ``driver``: a ResourceClaim whose
CEL selector requires ``memoryEnforcement == "driver"`` for the same memory, the pod
pinned to the node by its hostname label (a claim needs the scheduler). It waits for
the pod to finish, reads the probe's report from its log, deletes the pod (and the
claim) and prints the verdict. Exit status (the worst over the backends): 0 every limit
held, 1 one did not (the report says which), 3 the pod did not run or did not report
(why is printed), 2 no cluster or a usage error.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpushare.kube import nodestate
from gpushare.kube.kubectlapi import ApiError, Cluster
from gpushare.ops import deploy, imageref
from gpushare.ops.inspect import fetch_state_objects, state_texts
from gpushare.ops.printable import printable
from gpushare.probe.checks import REPORT_MARKER, Check, parse_report, verdict

EXIT_NOT_ENFORCED = 1
EXIT_NO_REPORT = 3
TERMINAL = ("Succeeded", "Failed")
#: Container states the kubelet does not leave by itself: waiting longer shows nothing new.
STUCK_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "ErrImageNeverPull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
        "CrashLoopBackOff",
    }
)
#: Pod events of the kubelet that say the pod's sandbox or volumes cannot be set up (no
#: container state shows these: the container stays ``ContainerCreating``) ...
STUCK_EVENTS = frozenset({"FailedCreatePodSandBox", "FailedMount"})
#: ... once the kubelet has tried this many times: a first failure may be a race it wins
#: on its next try (a volume's secret not yet there), a repeated one is what the node does.
STUCK_EVENT_TRIES = 2
#: A progress line at least this often while the pod has not finished (and on each change).
PROGRESS_SECONDS = 15.0
#: vcuda-core units of a whole card.
CORE_UNITS_PER_CARD = 100
#: The verify pod carries this label (to find leftovers: kubectl delete pod -l ...).
POD_LABEL = ("app.kubernetes.io/name", "gpushare-verify")


@dataclass(frozen=True)
class VerifyRequest:
    node: str
    namespace: str = "default"
    image: str | None = None
    memory_units: int = 4
    core_units: int = 30
    prefix: str = "gpushare.io"
    runtime_class: str | None = None
    timeout_seconds: float = 300.0
    keep: bool = False
    #: the memory backends to verify under; empty: each one the node offers for shares
    backends: tuple[str, ...] = ()
    memory_unit_mib: int = 256  # the node's unit (its annotation says; for driver claims)
    dra_driver: str = "gpu.gpushare.io"
    device_class: str = "gpushare.io"


#: Exit codes from the best to the worst (no report is worse than a limit not held).
SEVERITY = (0, EXIT_NOT_ENFORCED, EXIT_NO_REPORT)
#: The memory backends verify can prove (hardware needs no probe of a share).
VERIFIABLE = ("interposer", "driver")


def offered_backends(
    node: Mapping[str, Any], prefix: str, objects: Sequence[Mapping[str, Any]] = ()
) -> list[str]:
    """The memory backends the node's cards have for shares, as its state object (one of
    ``objects``, believed as ``inspect`` believes it) or else its annotation says; a
    daemon that does not say (older) offers the interposer."""
    from gpushare.kube import nodestate

    name = str((node.get("metadata") or {}).get("name") or "")
    text = state_texts([node], objects, prefix).get(name) or (
        (node.get("metadata") or {}).get("annotations") or {}
    ).get(nodestate.annotation_key(prefix))
    try:
        state = nodestate.decode(str(text)) if text is not None else None
    except ValueError:
        state = None
    if state is None or not state.enforcement:
        return ["interposer"]
    found = {e.memory for e in state.enforcement}
    return [b for b in VERIFIABLE if b in found] or ["interposer"]


def driver_claim(request: VerifyRequest, name: str, memory_mib: int) -> dict[str, Any]:
    """A ResourceClaim for ``memory_mib`` of a card whose memory the driver holds."""
    expression = f'device.attributes["{request.dra_driver}"].memoryEnforcement == "driver"'
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": name,
            "namespace": request.namespace,
            "labels": {POD_LABEL[0]: POD_LABEL[1]},
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpu",
                        "exactly": {
                            "deviceClassName": request.device_class,
                            "selectors": [{"cel": {"expression": expression}}],
                            "capacity": {"requests": {"memory": f"{memory_mib}Mi"}},
                        },
                    }
                ]
            }
        },
    }


def driver_pod(
    request: VerifyRequest, image: str, name: str, claim: str, memory_mib: int
) -> dict[str, Any]:
    """The probe's pod on a ``driver`` card: its claim, the limit it must find."""
    pod = verify_pod(request, image, name)
    spec = pod["spec"]
    del spec["nodeName"]  # the scheduler allocates the claim
    spec["nodeSelector"] = {"kubernetes.io/hostname": request.node}
    spec["resourceClaims"] = [{"name": "gpu", "resourceClaimName": claim}]
    (container,) = spec["containers"]
    container["command"] += ["--memory-backend", "driver", "--limit-mib", str(memory_mib)]
    container["resources"] = {"claims": [{"name": "gpu"}]}
    return pod


def installed_image(cluster: Cluster) -> str | None:
    """The image of the DaemonSet ``kubectl gpushare install`` applied, if any."""
    for obj in deploy.load_objects():
        if obj.get("kind") == "DaemonSet":
            stored = cluster.read(obj)
            if stored:
                containers = stored["spec"]["template"]["spec"].get("containers") or []
                if containers and containers[0].get("image"):
                    return str(containers[0]["image"])
    return None


def verify_pod(request: VerifyRequest, image: str, name: str) -> dict[str, Any]:
    """The pod that runs the probe on the node."""
    limits = {
        f"{request.prefix}/vcuda-memory": str(request.memory_units),
        f"{request.prefix}/vcuda-core": str(request.core_units),
    }
    spec: dict[str, Any] = {
        "nodeName": request.node,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 5,
        "containers": [
            {
                "name": "probe",
                "image": image,
                "command": ["python", "-m", "gpushare.probe"],
                "resources": {"limits": limits},
            }
        ],
        "tolerations": [{"operator": "Exists"}],
    }
    if request.runtime_class:
        spec["runtimeClassName"] = request.runtime_class
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": request.namespace,
            "labels": {POD_LABEL[0]: POD_LABEL[1]},
        },
        "spec": spec,
    }


def _why_not_running(pod: Mapping[str, Any]) -> str:
    status = pod.get("status") or {}
    parts = [str(status.get(k)) for k in ("phase", "reason", "message") if status.get(k)]
    for container in status.get("containerStatuses") or []:
        state = container.get("state") or {}
        for kind in ("waiting", "terminated"):
            if state.get(kind):
                detail = state[kind]
                parts.append(f"{kind}: {detail.get('reason', '')} {detail.get('message', '')}")
    return "; ".join(p.strip() for p in parts if p.strip()) or "no status yet"


def _stuck(pod: Mapping[str, Any]) -> str | None:
    """Why the pod can never finish on its own (a container stuck in a state of
    :data:`STUCK_REASONS`), else None."""
    for container in (pod.get("status") or {}).get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_REASONS:
            return f"{waiting['reason']}: {waiting.get('message') or 'no message'}"
    return None


def _times(event: Mapping[str, Any]) -> int:
    """How many times the kubelet reported ``event`` (``count``, or a series' count)."""
    counts = [event.get("count"), (event.get("series") or {}).get("count"), 1]
    return max(c for c in counts if isinstance(c, int) and not isinstance(c, bool))


def stuck_by_events(events: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the pod can never start, from its events: a reason of :data:`STUCK_EVENTS`
    reported :data:`STUCK_EVENT_TRIES` times or more (over one event's count or several
    events), with the latest such event's message; else None."""
    tries: dict[str, int] = {}
    latest: dict[str, Mapping[str, Any]] = {}
    for event in events:
        reason = str(event.get("reason") or "")
        if reason not in STUCK_EVENTS or event.get("type") == "Normal":
            continue
        tries[reason] = tries.get(reason, 0) + _times(event)
        latest[reason] = event  # the API server lists them oldest first
    for reason in sorted(tries):
        if tries[reason] >= STUCK_EVENT_TRIES:
            message = str(latest[reason].get("message") or "no message")
            return f"{reason} ({tries[reason]} times): {message}"
    return None


def _stuck_events(cluster: Cluster, namespace: str, uid: str) -> str | None:
    """:func:`stuck_by_events` over the pod's events; None where they cannot be read
    (no right to list events: verify then waits for the container states alone)."""
    if not uid:
        return None
    try:
        events = cluster.events(namespace, f"involvedObject.uid={uid}")
    except ApiError:
        return None
    return stuck_by_events(events)


def _progress(pod: Mapping[str, Any]) -> str:
    """``Pending (ContainerCreating)``: the phase and the container's waiting reason."""
    status = pod.get("status") or {}
    phase = str(status.get("phase") or "Pending")
    reasons = [
        str(((c.get("state") or {}).get("waiting") or {}).get("reason") or "")
        for c in status.get("containerStatuses") or []
    ]
    reasons = [r for r in reasons if r] or [str(status.get("reason") or "")]
    return f"{phase} ({', '.join(reasons)})" if any(reasons) else phase


class BadRequest(ValueError):
    """An argument verify cannot work with; the message is one line for the operator."""


def check_request(cluster: Cluster, request: VerifyRequest) -> None:
    """Refuse, in one line, what cannot be verified: impossible unit counts, an image
    that is no reference, a node that does not exist or runs no gpushare."""
    if request.memory_units < 1:
        raise BadRequest(
            f"--memory-units {request.memory_units}: the probe needs at least 1 unit"
        )
    if not 1 <= request.core_units <= CORE_UNITS_PER_CARD:
        raise BadRequest(
            f"--core-units {request.core_units}: give 1 to {CORE_UNITS_PER_CARD} "
            f"({CORE_UNITS_PER_CARD} is a whole card)"
        )
    if request.image is not None and (problem := imageref.problem(request.image)):
        raise BadRequest(f"--image {request.image!r}: {problem}")
    node = cluster.node(request.node)
    if node is None:
        raise ApiError(f"no such node: {request.node}")
    resource = f"{request.prefix}/vcuda-memory"
    allocatable = ((node.get("status") or {}).get("allocatable") or {}).get(resource)
    labels = (node.get("metadata") or {}).get("labels") or {}
    published = nodestate.label_key(request.prefix, "count") in labels
    if allocatable is None and not published:
        raise BadRequest(
            f"node {request.node} offers no {resource}: gpushare does not run there "
            f"(kubectl gpushare install --node {request.node}; another --resource-prefix?)"
        )
    if allocatable is not None and str(allocatable).isdigit():
        if int(allocatable) == 0:
            raise BadRequest(
                f"node {request.node} offers 0 {resource} units now (its daemon is starting "
                "or found no healthy card): nothing to verify"
            )
        if request.memory_units > int(allocatable):
            raise BadRequest(
                f"--memory-units {request.memory_units}: node {request.node} has "
                f"{allocatable} {resource} units in all"
            )


def _same_pod(stored: Mapping[str, Any] | None, uid: str) -> bool:
    """Whether ``stored`` is the pod verify created: a pod of the same name created by
    someone else after deleting it (its log could say anything) is not."""
    if stored is None:
        return False
    return not uid or str((stored.get("metadata") or {}).get("uid") or "") == uid


def run(
    cluster: Cluster,
    request: VerifyRequest,
    say: Callable[[str], None],
    *,
    poll_seconds: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    check_request(cluster, request)
    image = request.image or installed_image(cluster)
    if image is None:
        image = deploy.shipped_image(deploy.load_objects())
        say(deploy.unbuilt_image_warning(image))
    node = cluster.node(request.node)
    if node is None:
        raise ApiError(f"no such node: {request.node}")
    backends = list(request.backends) or offered_backends(
        node, request.prefix, fetch_state_objects(cluster, request.prefix)
    )
    worst = 0
    for backend in backends:
        if len(backends) > 1 or backend != "interposer":
            say(f"memory backend {backend}:")
        code = _run_one(cluster, request, image, backend, say, poll_seconds, clock)
        worst = max(worst, code, key=SEVERITY.index)
    return worst


def _run_one(
    cluster: Cluster,
    request: VerifyRequest,
    image: str,
    backend: str,
    say: Callable[[str], None],
    poll_seconds: float,
    clock: Callable[[], float],
) -> int:
    name = f"gpushare-verify-{secrets.token_hex(3)}"
    claim: dict[str, Any] | None = None
    if backend == "driver":
        memory_mib = request.memory_units * request.memory_unit_mib
        claim = driver_claim(request, name, memory_mib)
        cluster.create(claim)
        pod = driver_pod(request, image, name, name, memory_mib)
    else:
        pod = verify_pod(request, image, name)
    created = cluster.create(pod)
    uid = str((created.get("metadata") or {}).get("uid") or "")
    say(
        f"created pod {request.namespace}/{name} on {request.node} ({image}; "
        f"{request.memory_units} memory units, {request.core_units} core units"
        f"{', a driver claim' if claim else ''})"
    )
    try:
        stored = _finished(cluster, pod, uid, request, name, say, poll_seconds, clock)
        if stored is None:
            return EXIT_NO_REPORT
        try:
            log = cluster.pod_log(request.namespace, name) or ""
        except ApiError as exc:
            # The API server fetches a log from the node's kubelet (its address and port in
            # the Node's status): a node it cannot reach gives an error here, not a verdict.
            say(
                f"the probe's log could not be read ({printable(str(exc), 400)}): no verdict; "
                f"`kubectl logs` fails the same way while the API server cannot reach the "
                f"kubelet of {request.node}"
            )
            return EXIT_NO_REPORT
        if not _same_pod(cluster.read(pod), uid):  # the log read may be another pod's
            say("the pod was replaced before its log was read (by someone else?): no verdict")
            return EXIT_NO_REPORT
        checks = parse_report(log)
        if checks is None:
            tail = " | ".join(log.strip().splitlines()[-5:]) or "(empty log)"
            why = printable(_why_not_running(stored), 400)
            say(f"the probe did not report ({why}); log: {printable(tail, 1000)}")
            return EXIT_NO_REPORT
        return report(checks, say)
    finally:
        if request.keep:
            say(f"kept pod {request.namespace}/{name} (--keep)")
        else:
            cluster.delete(pod)
            if claim is not None:
                cluster.delete(claim)
            say(f"deleted pod {request.namespace}/{name}")


def _finished(
    cluster: Cluster,
    pod: dict[str, Any],
    uid: str,
    request: VerifyRequest,
    name: str,
    say: Callable[[str], None],
    poll_seconds: float,
    clock: Callable[[], float],
) -> dict[str, Any] | None:
    """The probe pod once it has finished, its progress said meanwhile; None (said why)
    when it is gone or replaced, cannot run, or did not finish in time."""
    started = clock()
    deadline = started + request.timeout_seconds
    stored: dict[str, Any] | None = None
    shown, shown_at = "", started
    while clock() < deadline:
        stored = cluster.read(pod)
        if stored is None or not _same_pod(stored, uid):
            say("the pod is gone before it finished (deleted by someone?)")
            return None
        if (stored.get("status") or {}).get("phase") in TERMINAL:
            return stored
        stuck = _stuck(stored) or _stuck_events(cluster, request.namespace, uid)
        if stuck is not None:
            say(f"the pod cannot run: {printable(stuck, 400)}")
            return None
        now, state = clock(), _progress(stored)
        if state != shown or now - shown_at >= PROGRESS_SECONDS:
            say(
                f"waiting for pod {request.namespace}/{name}: {printable(state, 200)} "
                f"({now - started:.0f} s of {request.timeout_seconds:.0f} s)"
            )
            shown, shown_at = state, now
        time.sleep(poll_seconds)
    say(
        f"the pod did not finish within {request.timeout_seconds:.0f} s: "
        f"{printable(_why_not_running(stored or {}), 400)}"
    )
    return None


def report(checks: list[Check], say: Callable[[str], None]) -> int:
    for check in checks:
        mark = "GAP " if check.gap else {True: "ok  ", False: "FAIL", None: "--  "}[check.ok]
        say(f"  {mark} {printable(check.name, 120)}: {printable(check.detail, 400)}")
    ok, failed = verdict(checks)
    if ok:
        say("VERDICT: enforced (every limit checked holds on this node)")
        return 0
    say(f"VERDICT: NOT ENFORCED: {', '.join(printable(name, 120) for name in failed)}")
    return EXIT_NOT_ENFORCED


__all__ = ["REPORT_MARKER", "VerifyRequest", "run", "verify_pod"]
