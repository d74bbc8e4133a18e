"""A prepare reads no reserving pod the daemon's pod watch already holds (gpushare.dra.mates).

The kubelet prepares a claim for a pod bound to its node, which the daemon's pod watch
(:class:`~gpushare.kube.podwatch.PodWatch`) follows: where the watch holds the pod with
every claim name its containers use, the prepare takes which claims share a container
from it and reads only the claim (one GET, not two). Where the watch does not hold the
pod (not listed yet) or holds it before a template's claim was named, the pod is read as
before. Either way the claims of one container are held to the smallest share among
them, in every order the runtime may apply their CDI devices. The API requests are
counted from the API-server double's request log.
"""

from __future__ import annotations

from typing import Any

import pytest
from test_dra_plugin import NODE, DraNode, dra, env_of, wait_until
from test_every_card_of_a_claim_limited import _check_every_order, _one_card

from gpushare.kube.podspecs import PodSpecBook
from gpushare.kube.podwatch import PodWatch
from gpushare.sim.drakubeletdouble import pod_using_claims

__all__ = ["dra"]  # fixture

POD_READS = "/api/v1/namespaces/default/pods/"
GRANTS = {"GPU-00000000": 1024, "GPU-00000001": 4096}


@pytest.fixture
def watched(dra: DraNode) -> PodWatch:
    """The DRA node of ``dra``, started with a pod watch of its node over the double
    (listed on demand by each test: no thread, no waiting)."""
    watch = PodWatch(lambda: dra.client, NODE, PodSpecBook("gpushare.io"))
    dra.watched_pod = watch.claim_pod
    dra.start()
    return watch


def _pod(node: DraNode, name: str, **kw: Any) -> str:
    """A pod of the node whose container ``main`` uses claims ``small`` and ``large``."""
    pod = pod_using_claims("default", name, NODE, {"main": ["small", "large"]}, **kw)
    return str(node.api.add(pod)["metadata"]["uid"])


def _prepare_both(node: DraNode, pod: str, uid: str) -> list[Any]:
    """Claims ``small`` (1 GiB of gpu-0) and ``large`` (4 GiB of gpu-1), reserved for the
    pod, prepared in one call; both must be held to 1 GiB."""
    refs = [
        _one_card(node, "small", "gpu-0", "1Gi", (pod, uid)),
        _one_card(node, "large", "gpu-1", "4Gi", (pod, uid)),
    ]
    answers = node.kubelet.prepare(refs)
    assert [a.error for a in answers.values()] == ["", ""]
    specs = [node.spec(r[2]) for r in refs]
    assert [env_of(s)["CUDA_DEVICE_MEMORY_LIMIT"] for s in specs] == ["1024m", "1024m"]
    _check_every_order(specs, GRANTS)
    return refs


def test_a_pod_the_watch_holds_is_not_read(dra: DraNode, watched: PodWatch) -> None:
    uid = _pod(dra, "both")
    assert watched.refresh_now()  # the watch's list: it holds the pod now
    assert watched.claim_pod(uid) is not None
    _prepare_both(dra, "both", uid)
    assert dra.api.calls("GET", POD_READS) == []
    assert len(dra.api.calls("GET", "/resourceclaims/")) == 2  # each claim, once


def test_a_pod_the_watch_does_not_hold_is_read(dra: DraNode, watched: PodWatch) -> None:
    uid = _pod(dra, "both")  # the watch has not listed: it holds nothing
    assert watched.claim_pod(uid) is None
    _prepare_both(dra, "both", uid)
    assert [c.path for c in dra.api.calls("GET", POD_READS)] == [f"{POD_READS}both"]


def test_a_pod_the_watch_holds_before_its_template_claim_is_named_is_read(
    dra: DraNode, watched: PodWatch
) -> None:
    """The watch listed the pod before the resourceclaim controller named the claim of
    its template: the prepare reads the pod, which names it now."""
    templated = {"templates": {"large": "scratch"}}
    pod = pod_using_claims("default", "tmpl", NODE, {"main": ["small", "large"]}, **templated)
    named = pod["status"]["resourceClaimStatuses"]
    pod["status"]["resourceClaimStatuses"] = []
    stored = dra.api.add(pod)
    uid = str(stored["metadata"]["uid"])
    assert watched.refresh_now()
    assert watched.claim_pod(uid) is not None  # held, but with the claim not named
    stored["status"]["resourceClaimStatuses"] = named
    dra.api.add(stored)  # the controller's update; the watch has not seen it
    _prepare_both(dra, "tmpl", uid)
    assert [c.path for c in dra.api.calls("GET", POD_READS)] == [f"{POD_READS}tmpl"]


def test_a_watched_pod_of_another_name_is_not_taken(dra: DraNode, watched: PodWatch) -> None:
    """The claim names the pod by name and UID: a watched pod of that UID under another
    name (a claim's hostile or stale record) is not used; the named pod is read."""
    uid = _pod(dra, "both")
    assert watched.refresh_now()
    refs = [_one_card(dra, "small", "gpu-0", "1Gi", ("other", uid))]
    assert [a.error for a in dra.kubelet.prepare(refs).values()] == [""]
    assert [c.path for c in dra.api.calls("GET", POD_READS)] == [f"{POD_READS}other"]


def test_the_watch_follows_a_pod_until_it_ends_and_then_it_is_read(
    dra: DraNode, watched: PodWatch
) -> None:
    """Watch events: a pod is held once bound to the node and forgotten once it ends (a
    claim reserved for it is then prepared from the pod as read: ended, so skipped)."""
    watched.start()
    try:
        uid = _pod(dra, "both")
        assert wait_until(lambda: watched.claim_pod(uid) is not None)
        stored = dra.api.get("Pod", "both", "default")
        assert stored is not None
        stored["status"]["phase"] = "Succeeded"
        dra.api.add(stored)
        assert wait_until(lambda: watched.claim_pod(uid) is None)
    finally:
        watched.stop()
    ref = _one_card(dra, "large", "gpu-1", "4Gi", ("both", uid))
    assert [a.error for a in dra.kubelet.prepare([ref]).values()] == [""]
    assert env_of(dra.spec(ref[2]))["CUDA_DEVICE_MEMORY_LIMIT"] == "4096m"  # alone now
    assert [c.path for c in dra.api.calls("GET", POD_READS)] == [f"{POD_READS}both"]
