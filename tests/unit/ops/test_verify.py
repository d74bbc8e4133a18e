"""``kubectl gpushare verify`` and the enforcement probe, without a GPU.

The probe's judgements are pure functions of its measurements (tested here on figures);
its GPU part runs in tests/on_gpu/test_probe_real_gpu.py (``pytest -m gpu``). The subcommand runs
against the API-server double, with a stand-in for the node that finishes the pod and
writes a probe report into its log.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kit.kube_double import KubeApiDouble

from gpushare.kube.kubectlapi import Cluster
from gpushare.ops import kubectl, verify
from gpushare.probe import checks as probe
from gpushare.probe.checks import Check
from gpushare.sim.podstatus import ended_status

MIB = 1 << 20
LIMIT = 1024 * MIB


def test_sizes_are_read_as_hami_core_reads_them() -> None:
    assert probe.parse_size("1024m") == LIMIT
    assert probe.parse_size("2g") == 2 << 30
    assert probe.parse_size("4096") == 4096
    assert probe.parse_size("x") is None and probe.parse_size("") is None


def test_what_the_container_sees() -> None:
    env = {"NVIDIA_VISIBLE_DEVICES": "GPU-1", "LD_PRELOAD": "/usr/local/vgpu/libvgpu.so"}
    maps = "7f00-7f01 r-xp 0 08:01 1 /usr/local/vgpu/libvgpu.so\n"
    visible, loaded = probe.seen_checks(env, maps, "")
    assert visible.ok and loaded.ok and "LD_PRELOAD" in loaded.detail
    _, named_only = probe.seen_checks(env, "", "")
    assert named_only.ok is False and "NOT mapped" in named_only.detail
    two, _ = probe.seen_checks({"NVIDIA_VISIBLE_DEVICES": "GPU-1,GPU-2"}, "", "")
    assert two.ok is False
    _, by_file = probe.seen_checks({}, maps, "/usr/local/vgpu/libvgpu.so\n")
    assert by_file.ok and "/etc/ld.so.preload" in by_file.detail


@pytest.mark.parametrize(
    "allocated,stopped,ok",
    [(LIMIT - 64 * MIB, True, True), (LIMIT, True, True), (LIMIT * 2, True, False),
     (int(LIMIT * 1.5), False, False)],
)  # fmt: skip
def test_allocation_must_stop_at_the_limit(allocated: int, stopped: bool, ok: bool) -> None:
    assert probe.judge_allocation("a", allocated, LIMIT, stopped).ok is ok


def test_bypasses_totals_sharing_and_compute() -> None:
    assert probe.judge_bypass("async", 2, LIMIT * 2, LIMIT, False).ok is True
    granted = probe.judge_bypass("async", 0, LIMIT * 2, LIMIT, False)
    assert granted.ok is False and "GRANTED" in granted.detail
    assert probe.judge_bypass("create", 801, 0, LIMIT, True).ok is None
    assert probe.judge_total("t", LIMIT, LIMIT).ok
    assert not probe.judge_total("t", 8 * LIMIT, LIMIT).ok
    assert probe.judge_shared("s", 600 * MIB, 400 * MIB, LIMIT).ok
    assert not probe.judge_shared("s", 600 * MIB, 1000 * MIB, LIMIT).ok
    assert probe.judge_compute(30.0, 100.0, 30).ok
    assert probe.judge_compute(95.0, 100.0, 30).ok is False
    assert probe.judge_compute(100.0, 100.0, 100).ok is None


GOOD = [
    Check("one card visible", True, "NVIDIA_VISIBLE_DEVICES=GPU-1"),
    Check("cuMemAlloc_v2 stops at the limit", True, "stopped after 1000 MiB", "memory"),
    Check("compute at the core limit", True, "throughput 31 %", "compute"),
]
BAD = [*GOOD[:2], Check("cuMemAllocAsync cannot pass the limit", False, "GRANTED", "memory")]


def test_the_report_round_trips_through_the_log() -> None:
    text = probe.render(BAD)
    assert "VERDICT: NOT ENFORCED: cuMemAllocAsync cannot pass the limit" in text
    assert probe.parse_report("noise\n" + text) == BAD
    assert probe.parse_report("no report here") is None
    assert probe.parse_report(probe.REPORT_MARKER + "[{]") is None


# -- the subcommand against the API-server double ----------------------------------------


@pytest.fixture
def cluster(api: KubeApiDouble) -> Iterator[Cluster]:
    api.add(
        {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": "gpu-1", "labels": {}},
            "status": {"allocatable": {"gpushare.io/vcuda-memory": "58"}},
        }
    )
    yield Cluster()


class StandInNode:
    """Finishes the verify pod with ``phase`` (its container's exit: 0 or the probe's 2, the
    status as a real kubelet writes it) and writes ``log`` as its container's log."""

    def __init__(self, api: KubeApiDouble, phase: str | None, log: str) -> None:
        self.api, self.phase, self.log = api, phase, log
        self.seen: dict[str, Any] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, obj in list(self.api.objects.items()):
                if "/pods/gpushare-verify-" in key and not self.seen:
                    self.seen = obj
                    if self.phase is not None:
                        self.api.logs[key] = self.log
                        exit_code = 0 if self.phase == "Succeeded" else 2
                        with self.api._lock:
                            obj.setdefault("status", {}).update(ended_status("probe", exit_code))
            self._stop.wait(0.02)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _run(api: KubeApiDouble, cluster: Cluster, phase: str | None, log: str,
         **request: Any) -> tuple[int, list[str], StandInNode]:  # fmt: skip
    node = StandInNode(api, phase, log)
    said: list[str] = []
    try:
        code = verify.run(
            cluster, verify.VerifyRequest(node="gpu-1", image="reg/gpushare:1", **request),
            said.append, poll_seconds=0.02,
        )  # fmt: skip
    finally:
        node.stop()
    return code, said, node


def _pods(api: KubeApiDouble) -> list[str]:
    return [k for k in api.objects if "/pods/gpushare-verify-" in k]


def test_an_enforcing_node_gets_verdict_enforced_and_the_pod_is_removed(
    api: KubeApiDouble, cluster: Cluster
) -> None:
    code, said, node = _run(api, cluster, "Succeeded", "starting\n" + probe.render(GOOD))
    assert code == 0
    assert said[-2] == "VERDICT: enforced (every limit checked holds on this node)"
    spec = node.seen["spec"]
    assert spec["nodeName"] == "gpu-1" and spec["restartPolicy"] == "Never"
    (container,) = spec["containers"]
    assert container["image"] == "reg/gpushare:1"
    assert container["command"] == ["python", "-m", "gpushare.probe"]
    assert container["resources"]["limits"] == {
        "gpushare.io/vcuda-memory": "4",
        "gpushare.io/vcuda-core": "30",
    }
    assert _pods(api) == [] and said[-1].startswith("deleted pod default/gpushare-verify-")


def test_a_limit_not_enforced_exits_1_and_says_which(api: KubeApiDouble, cluster: Cluster) -> None:
    code, said, _ = _run(api, cluster, "Failed", probe.render(BAD))
    assert code == verify.EXIT_NOT_ENFORCED
    assert "  FAIL cuMemAllocAsync cannot pass the limit: GRANTED" in said
    assert "VERDICT: NOT ENFORCED: cuMemAllocAsync cannot pass the limit" in said


def test_a_pod_that_never_runs_or_never_reports_exits_3(
    api: KubeApiDouble, cluster: Cluster
) -> None:
    code, said, _ = _run(api, cluster, None, "", timeout_seconds=0.3)
    assert code == verify.EXIT_NO_REPORT and "did not finish within" in said[-2]
    log = "probe: cannot run: libcuda.so.1: cannot open shared object file\n"
    code, said, _ = _run(api, cluster, "Failed", log)
    assert code == verify.EXIT_NO_REPORT
    # docs/operations.md's line for a node without a GPU, as verify prints it on a real one
    assert said[-2] == f"the probe did not report (Failed; terminated: Error); log: {log.strip()}"
    assert _pods(api) == []


def test_a_log_the_api_server_cannot_fetch_exits_3_with_why(
    api: KubeApiDouble, cluster: Cluster
) -> None:
    """The API server answers 500 for the log when it cannot reach the node's kubelet (seen
    on the e2e's nodes before they had an address): one line and exit 3, the pod deleted,
    never a traceback or a bare API error."""
    api.fail_next(1, 500, "/log")
    code, said, _ = _run(api, cluster, "Succeeded", probe.render(GOOD))
    assert code == verify.EXIT_NO_REPORT
    assert said[-2].startswith("the probe's log could not be read ("), said
    assert "no verdict" in said[-2] and "gpu-1" in said[-2]
    assert _pods(api) == [] and said[-1].startswith("deleted pod default/gpushare-verify-")


def test_keep_leaves_the_pod(api: KubeApiDouble, cluster: Cluster) -> None:
    code, said, _ = _run(api, cluster, "Succeeded", probe.render(GOOD), keep=True)
    assert code == 0 and len(_pods(api)) == 1 and said[-1].startswith("kept pod")


def test_the_kubectl_subcommand_runs_it(
    api: KubeApiDouble, cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    node = StandInNode(api, "Succeeded", probe.render(GOOD))
    try:
        code = kubectl.main(["verify", "--node", "gpu-1", "--image", "reg/gpushare:1"])
    finally:
        node.stop()
    assert code == 0
    assert "VERDICT: enforced" in capsys.readouterr().out
    assert kubectl.main(["verify", "--node", "nope", "--image", "x"]) == 1
    assert "no such node: nope" in capsys.readouterr().err


def test_without_an_image_it_warns_and_uses_the_shipped_reference(
    api: KubeApiDouble, cluster: Cluster
) -> None:
    node = StandInNode(api, "Succeeded", probe.render(GOOD))
    said: list[str] = []
    try:
        verify.run(cluster, verify.VerifyRequest(node="gpu-1"), said.append, poll_seconds=0.02)
    finally:
        node.stop()
    assert said[0].startswith("warning: no --image given")


def test_the_probe_without_a_driver_exits_2_with_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "gpushare.probe", "--library", str(tmp_path / "none.so")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("probe: cannot run:")


def test_a_hostile_report_is_printed_escaped_on_one_line(
    api: KubeApiDouble, cluster: Cluster
) -> None:
    evil = [Check("x\x1b[2J\nVERDICT: enforced", False, "\u202eevil\r", "memory")]
    code, said, _ = _run(api, cluster, "Succeeded", probe.render(evil))
    assert code == verify.EXIT_NOT_ENFORCED
    assert all("\x1b" not in line and "\n" not in line and "\u202e" not in line for line in said)


class Impostor(StandInNode):
    """Deletes the verify pod and creates one of the same name (another UID) that
    "finishes" at once with an enforcing report: a forged verdict."""

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, obj in list(self.api.objects.items()):
                if "/pods/gpushare-verify-" in key and not self.seen:
                    self.seen = obj
                    fake = {
                        **obj,
                        "metadata": {**obj["metadata"], "uid": "uid-impostor"},
                        "status": {"phase": "Succeeded"},
                    }
                    with self.api._lock:
                        self.api.objects[key] = fake
                    self.api.logs[key] = self.log
            self._stop.wait(0.02)


def test_a_pod_replaced_under_the_same_name_gives_no_verdict(
    api: KubeApiDouble, cluster: Cluster
) -> None:
    node = Impostor(api, "Succeeded", probe.render(GOOD))
    said: list[str] = []
    try:
        code = verify.run(
            cluster, verify.VerifyRequest(node="gpu-1", image="reg/gpushare:1"), said.append,
            poll_seconds=0.02,
        )  # fmt: skip
    finally:
        node.stop()
    assert code == verify.EXIT_NO_REPORT
    assert not any(line.startswith("VERDICT") for line in said)
    assert "gone before it finished" in said[-2]


class HostileStatus(StandInNode):
    """Leaves the verify pod Pending with a status message full of terminal escapes
    (anyone who may write pods/status there can)."""

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, obj in list(self.api.objects.items()):
                if "/pods/gpushare-verify-" in key and not self.seen:
                    self.seen = obj
                    with self.api._lock:
                        obj["status"] = {"phase": "Pending", "message": "\x1b[2J\nVERDICT: ok"}
            self._stop.wait(0.02)


def test_a_hostile_status_of_a_pod_that_never_finishes_is_printed_escaped(
    api: KubeApiDouble, cluster: Cluster
) -> None:
    node = HostileStatus(api, None, "")
    said: list[str] = []
    try:
        code = verify.run(
            cluster,
            verify.VerifyRequest(node="gpu-1", image="reg/gpushare:1", timeout_seconds=0.5),
            said.append, poll_seconds=0.02,
        )  # fmt: skip
    finally:
        node.stop()
    assert code == verify.EXIT_NO_REPORT
    assert node.seen, "the stand-in never saw the pod"
    assert "did not finish within" in said[-2] and "\\x1b[2J\\x0aVERDICT: ok" in said[-2]
    assert all("\x1b" not in line and "\n" not in line for line in said)


# -- issue 33.3: progress, the first terminal state, impossible arguments -----------------


class StuckNode(StandInNode):
    """Leaves the verify pod waiting with ``reason`` (the kubelet cannot pull its image)."""

    def __init__(self, api: KubeApiDouble, reason: str) -> None:
        self.reason = reason
        super().__init__(api, None, "")

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, obj in list(self.api.objects.items()):
                if "/pods/gpushare-verify-" in key and not self.seen:
                    self.seen = obj
                    waiting = {"reason": self.reason, "message": "Back-off pulling image x"}
                    with self.api._lock:
                        obj["status"] = {
                            "phase": "Pending",
                            "containerStatuses": [{"name": "probe", "state": {"waiting": waiting}}],
                        }
            self._stop.wait(0.02)


@pytest.mark.parametrize("reason", ["ImagePullBackOff", "ErrImagePull"])
def test_a_pod_that_cannot_pull_its_image_stops_verify_at_once_with_the_reason(
    api: KubeApiDouble, cluster: Cluster, reason: str
) -> None:
    node = StuckNode(api, reason)
    said: list[str] = []
    try:
        code = verify.run(
            cluster,
            verify.VerifyRequest(node="gpu-1", image="reg/gpushare:1", timeout_seconds=3600),
            said.append,
            poll_seconds=0.02,
        )
    finally:
        node.stop()
    assert code == verify.EXIT_NO_REPORT
    assert f"the pod cannot run: {reason}: Back-off pulling image x" in said
    assert _pods(api) == []


def test_verify_says_what_it_waits_for(api: KubeApiDouble, cluster: Cluster) -> None:
    ticks = iter(range(0, 10_000, 5))  # each reading of the clock is 5 s later
    node = StandInNode(api, None, "")
    said: list[str] = []
    try:
        code = verify.run(
            cluster,
            verify.VerifyRequest(node="gpu-1", image="reg/gpushare:1", timeout_seconds=60),
            said.append,
            poll_seconds=0.01,
            clock=lambda: float(next(ticks)),
        )
    finally:
        node.stop()
    assert code == verify.EXIT_NO_REPORT
    waits = [line for line in said if line.startswith("waiting for pod default/gpushare-verify-")]
    # the first reading, then one line per 15 s of an unchanged state (60 s: 3 or 4)
    assert 3 <= len(waits) <= 4 and ": Pending (" in waits[0]
    seconds = [int(line.rsplit("(", 1)[1].split(" ")[0]) for line in waits]
    assert all(later - earlier >= 15 for earlier, later in itertools.pairwise(seconds))
    assert said[-2].startswith("the pod did not finish within 60 s")


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--memory-units", "0"], "--memory-units 0: the probe needs at least 1 unit"),
        (["--core-units", "150"], "--core-units 150: give 1 to 100 (100 is a whole card)"),
        (["--core-units", "0"], "--core-units 0: give 1 to 100"),
        (["--memory-units", "59"], "--memory-units 59: node gpu-1 has 58"),
        (["--image", "Reg/GPUSHARE:1"], "must be lower case"),
        (["--node", "cpu-1"], "node cpu-1 offers no gpushare.io/vcuda-memory"),
    ],
)
def test_impossible_arguments_are_refused_in_one_line_before_any_pod(
    api: KubeApiDouble,
    cluster: Cluster,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    expected: str,
) -> None:
    api.add({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "cpu-1"}})
    node = ["--node", "gpu-1"] if "--node" not in args else []
    assert kubectl.main(["verify", *node, "--image", "reg/gpushare:1", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err, err
    assert not api.calls("POST")


def _with_enforcement(api: KubeApiDouble, *backends: str) -> None:
    from gpushare.kube import nodestate

    enforcement = tuple(
        nodestate.CardEnforcement(f"GPU-{i}", i, b, "interposer") for i, b in enumerate(backends)
    )
    state = nodestate.NodeGpuState(1, "now", 256, (), enforcement=enforcement)
    key = nodestate.annotation_key("gpushare.io")
    api.add({"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": "gpu-1", "labels": {nodestate.label_key("gpushare.io", "count"): "1"},
        "annotations": {key: nodestate.encode(state)}}})  # fmt: skip


def test_the_offered_backends_come_from_the_nodes_annotation(api: KubeApiDouble) -> None:
    assert verify.offered_backends({"metadata": {}}, "gpushare.io") == ["interposer"]
    _with_enforcement(api, "driver", "interposer", "hardware")
    node = Cluster().node("gpu-1")
    assert node is not None
    assert verify.offered_backends(node, "gpushare.io") == ["interposer", "driver"]


def test_the_offered_backends_come_from_the_state_object_first(api: KubeApiDouble) -> None:
    from gpushare.kube import nodestate, stateobject

    _with_enforcement(api, "interposer")
    node = Cluster().node("gpu-1")
    assert node is not None
    enforcement = (nodestate.CardEnforcement("GPU-0", 0, "driver", "interposer", ""),)
    state = nodestate.NodeGpuState(2, "now", 256, (), enforcement=enforcement)
    text = nodestate.encode(state)
    uid = node["metadata"]["uid"]
    objects = [stateobject.state_object("gpushare.io", "kube-system", "gpu-1", uid, text)]
    assert verify.offered_backends(node, "gpushare.io") == ["interposer"]
    assert verify.offered_backends(node, "gpushare.io", objects) == ["driver"]


def test_a_driver_card_is_verified_through_a_claim_that_requires_driver(
    api: KubeApiDouble, cluster: Cluster
) -> None:
    _with_enforcement(api, "driver")
    claims: list[dict[str, Any]] = []
    original = cluster.create

    def create(obj: Any) -> dict[str, Any]:
        if obj["kind"] == "ResourceClaim":
            claims.append(obj)
        return original(obj)

    cluster.create = create  # type: ignore[method-assign]
    code, said, node = _run(api, cluster, "Succeeded", probe.render(GOOD))
    assert code == 0 and said[0] == "memory backend driver:"
    (claim,) = claims
    (request,) = claim["spec"]["devices"]["requests"]
    (selector,) = request["exactly"]["selectors"]
    assert selector["cel"]["expression"] == (
        'device.attributes["gpu.gpushare.io"].memoryEnforcement == "driver"'
    )
    assert request["exactly"]["capacity"]["requests"] == {"memory": "1024Mi"}
    spec = node.seen["spec"]
    assert "nodeName" not in spec and spec["nodeSelector"] == {"kubernetes.io/hostname": "gpu-1"}
    (container,) = spec["containers"]
    assert container["command"][-4:] == ["--memory-backend", "driver", "--limit-mib", "1024"]
    assert [k for k in api.objects if "resourceclaims" in k.lower()] == []  # deleted after


# -- issue 39.5: a pod whose sandbox the node cannot create ends verify in its verdict ----


def _event(reason: str, count: int | None = 1, message: str = "m", **extra: Any) -> dict[str, Any]:
    event: dict[str, Any] = {"reason": reason, "type": "Warning", "message": message, **extra}
    if count is not None:
        event["count"] = count
    return event


def test_a_sandbox_or_mount_failure_is_stuck_once_the_kubelet_tried_twice() -> None:
    sandbox = "FailedCreatePodSandBox"
    assert verify.stuck_by_events([]) is None
    assert verify.stuck_by_events([_event(sandbox)]) is None  # a first try may be a race
    assert verify.stuck_by_events([_event(sandbox, 2, "no network")]) == (
        "FailedCreatePodSandBox (2 times): no network"
    )
    # several events of one reason add up; the latest message is the one shown
    two = [_event("FailedMount", 1, "old"), _event("FailedMount", None, "new")]
    assert verify.stuck_by_events(two) == "FailedMount (2 times): new"
    assert verify.stuck_by_events([_event(sandbox, None, series={"count": 3})]) == (
        "FailedCreatePodSandBox (3 times): m"
    )
    # other reasons, a Normal event, and one try of each of two reasons are no verdict
    assert verify.stuck_by_events([_event("Scheduled", 9), _event("BackOff", 5)]) is None
    assert verify.stuck_by_events([_event(sandbox, 4, type="Normal")]) is None
    assert verify.stuck_by_events([_event(sandbox), _event("FailedMount")]) is None
    # a count that is no number counts once
    assert verify.stuck_by_events([_event(sandbox, None), _event(sandbox, "x")]) is not None  # type: ignore[arg-type]


class SandboxNode(StandInNode):
    """Leaves the verify pod ``ContainerCreating`` and reports ``tries`` failed sandbox
    creations as one event of the pod (its ``count``), as a kubelet without a pod network."""

    def __init__(self, api: KubeApiDouble, tries: int) -> None:
        self.tries = tries
        super().__init__(api, None, "")

    def _run(self) -> None:
        while not self._stop.is_set():
            for key, obj in list(self.api.objects.items()):
                if "/pods/gpushare-verify-" in key and not self.seen:
                    self.seen = obj
                    waiting = {"reason": "ContainerCreating"}
                    with self.api._lock:
                        obj["status"] = {
                            "phase": "Pending",
                            "containerStatuses": [{"name": "probe", "state": {"waiting": waiting}}],
                        }
                    meta = obj["metadata"]
                    self.api.add(
                        {
                            "apiVersion": "v1",
                            "kind": "Event",
                            "metadata": {"name": f"{meta['name']}.1", "namespace": "default"},
                            "involvedObject": {"kind": "Pod", "uid": meta["uid"]},
                            "reason": "FailedCreatePodSandBox",
                            "type": "Warning",
                            "count": self.tries,
                            "message": 'failed to find plugin "loopback"',
                        }
                    )
            self._stop.wait(0.02)


@pytest.mark.parametrize("tries", [2, 7])
def test_a_pod_whose_sandbox_fails_again_stops_verify_with_the_kubelets_message(
    api: KubeApiDouble, cluster: Cluster, tries: int
) -> None:
    node = SandboxNode(api, tries)
    said: list[str] = []
    try:
        code = verify.run(
            cluster,
            verify.VerifyRequest(node="gpu-1", image="reg/gpushare:1", timeout_seconds=3600),
            said.append,
            poll_seconds=0.02,
        )
    finally:
        node.stop()
    assert code == verify.EXIT_NO_REPORT
    expected = (
        f"the pod cannot run: FailedCreatePodSandBox ({tries} times): "
        'failed to find plugin "loopback"'
    )
    assert expected in said
    assert not any("did not finish within" in line for line in said)
    assert _pods(api) == []
    # it asked for the pod's own events only
    asked = api.calls("GET", "/namespaces/default/events")
    assert asked and all(
        c.query.get("fieldSelector") == [f"involvedObject.uid={node.seen['metadata']['uid']}"]
        for c in asked
    )


def test_one_failed_sandbox_is_waited_out_to_the_timeout(
    api: KubeApiDouble, cluster: Cluster
) -> None:
    ticks = iter(range(0, 10_000, 5))
    node = SandboxNode(api, 1)
    said: list[str] = []
    try:
        code = verify.run(
            cluster,
            verify.VerifyRequest(node="gpu-1", image="reg/gpushare:1", timeout_seconds=60),
            said.append,
            poll_seconds=0.01,
            clock=lambda: float(next(ticks)),
        )
    finally:
        node.stop()
    assert code == verify.EXIT_NO_REPORT
    assert node.seen, "the stand-in never saw the pod"
    assert said[-2].startswith("the pod did not finish within 60 s")
    assert not any("cannot run" in line for line in said)
