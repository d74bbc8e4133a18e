"""``kubectl gpushare verify --node NAME``: prove on a node that limits are enforced.

It creates one short-lived pod on the node (``spec.nodeName``: no scheduler involved)
asking for a small share (by default 4 memory units and 30 core units), running the
gpushare image's enforcement probe (:mod:`gpushare.gpu.probe`) in the container the
kubelet and the daemon set up, waits for it to finish, reads the probe's report from its
log, deletes the pod and prints the verdict. Exit status: 0 every limit held, 1 one did
not (the report says which), 3 the pod did not run or did not report (why is printed),
2 no cluster or a usage error.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpushare.gpu.probe import REPORT_MARKER, Check, parse_report, verdict
from gpushare.kube.kubectlapi import ApiError, Cluster
from gpushare.ops import deploy
from gpushare.ops.printable import printable

EXIT_NOT_ENFORCED = 1
EXIT_NO_REPORT = 3
TERMINAL = ("Succeeded", "Failed")
#: The verify pod carries this label (to find leftovers: kubectl delete pod -l ...).
POD_LABEL = ("app.kubernetes.io/name", "gpushare-verify")


@dataclass(frozen=True)
class Request:
    node: str
    namespace: str = "default"
    image: str | None = None
    memory_units: int = 4
    core_units: int = 30
    prefix: str = "gpushare.io"
    runtime_class: str | None = None
    timeout_seconds: float = 300.0
    keep: bool = False


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


def verify_pod(request: Request, image: str, name: str) -> dict[str, Any]:
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
                "command": ["python", "-m", "gpushare.gpu.probe"],
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


def _same_pod(stored: Mapping[str, Any] | None, uid: str) -> bool:
    """Whether ``stored`` is the pod verify created: a pod of the same name created by
    someone else after deleting it (its log could say anything) is not."""
    if stored is None:
        return False
    return not uid or str((stored.get("metadata") or {}).get("uid") or "") == uid


def run(
    cluster: Cluster,
    request: Request,
    say: Callable[[str], None],
    *,
    poll_seconds: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    image = request.image or installed_image(cluster)
    if image is None:
        image = deploy.shipped_image(deploy.load_objects())
        say(deploy.unbuilt_image_warning(image))
    if cluster.node(request.node) is None:
        raise ApiError(f"no such node: {request.node}")
    name = f"gpushare-verify-{secrets.token_hex(3)}"
    pod = verify_pod(request, image, name)
    created = cluster.create(pod)
    uid = str((created.get("metadata") or {}).get("uid") or "")
    say(
        f"created pod {request.namespace}/{name} on {request.node} ({image}; "
        f"{request.memory_units} memory units, {request.core_units} core units)"
    )
    try:
        deadline = clock() + request.timeout_seconds
        stored: dict[str, Any] | None = None
        while clock() < deadline:
            stored = cluster.read(pod)
            if stored is None or not _same_pod(stored, uid):
                say("the pod is gone before it finished (deleted by someone?)")
                return EXIT_NO_REPORT
            if (stored.get("status") or {}).get("phase") in TERMINAL:
                break
            time.sleep(poll_seconds)
        else:
            say(
                f"the pod did not finish within {request.timeout_seconds:.0f} s: "
                f"{printable(_why_not_running(stored or {}), 400)}"
            )
            return EXIT_NO_REPORT
        log = cluster.pod_log(request.namespace, name) or ""
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
            say(f"deleted pod {request.namespace}/{name}")


def report(checks: list[Check], say: Callable[[str], None]) -> int:
    for check in checks:
        mark = {True: "ok  ", False: "FAIL", None: "--  "}[check.ok]
        say(f"  {mark} {printable(check.name, 120)}: {printable(check.detail, 400)}")
    ok, failed = verdict(checks)
    if ok:
        say("VERDICT: enforced (every limit checked holds on this node)")
        return 0
    say(f"VERDICT: NOT ENFORCED: {', '.join(printable(name, 120) for name in failed)}")
    return EXIT_NOT_ENFORCED


__all__ = ["REPORT_MARKER", "Request", "run", "verify_pod"]
