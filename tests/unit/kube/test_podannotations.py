"""The API link's pod annotations (kube/podannotations.py), against the API-server double:
each container's card written once (its two resources name the same card), a pod that is
gone dropped, an Allocate whose holder the records do not name yet tried again, and what
was left kept when the API server cannot be reached."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpushare.kube import nodestate
from gpushare.kube.podannotations import POD_ANNOTATION_TRIES, PodAnnotator
from gpushare.kube.podspecs import PodSpecBook
from gpushare.kube.stdlibclient import ApiClient, ApiStatusError, kubeconfig_endpoint
from gpushare.share.devices import Resource
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder
from gpushare.sim.apidouble import KubeApiDouble

PREFIX = "gpushare.io"
PODS = "/api/v1/namespaces/default/pods"


def client(api: KubeApiDouble, tmp: Path) -> ApiClient:
    return ApiClient(kubeconfig_endpoint(api.kubeconfig(tmp / "kubeconfig")))


def pod(api: KubeApiDouble, name: str) -> None:
    api.add({"apiVersion": "v1", "kind": "Pod",
             "metadata": {"name": name, "namespace": "default", "uid": f"uid-{name}"}})  # fmt: skip


def records(*held: tuple[Resource, str, str]) -> Snapshot:
    """Each (resource, first device ID, pod) held by the pod's container ``main``."""
    return Snapshot(
        taken_at=0.0,
        holders={(r, first): Holder("default", name, "main") for r, first, name in held},
    )


def annotation(api: KubeApiDouble, name: str) -> str | None:
    stored = api.get("Pod", name, "default")
    assert stored is not None
    value = (stored["metadata"].get("annotations") or {}).get(
        nodestate.pod_annotation_key(PREFIX, "main")
    )
    return str(value) if value is not None else None


def test_a_container_is_annotated_once_with_its_card(api: KubeApiDouble, short_tmp: Path) -> None:
    pod(api, "a")
    annotator = PodAnnotator(PREFIX, PodSpecBook(PREFIX))
    annotator.shared(Resource.MEMORY, "GPU-1", "GPU-1::0")
    annotator.shared(Resource.CORE, "GPU-1", "GPU-1::c0")
    republished: list[int] = []
    held = records((Resource.MEMORY, "GPU-1::0", "a"), (Resource.CORE, "GPU-1::c0", "a"))
    annotator.annotate(client(api, short_tmp), held, lambda: republished.append(1))
    assert annotation(api, "a") == "GPU-1"
    assert len(api.calls("PATCH", "/pods/a")) == 1  # the second resource is skipped
    assert annotator.handled == 2 and not annotator and republished == []


def test_whole_devices_are_annotated_and_published_again(
    api: KubeApiDouble, short_tmp: Path
) -> None:
    pod(api, "w")
    annotator = PodAnnotator(PREFIX, PodSpecBook(PREFIX))
    annotator.exclusive(f"{PREFIX}/gpu", ["GPU-2", "GPU-3"])
    held = Snapshot(0.0, exclusive={f"{PREFIX}/gpu": {"GPU-2": Holder("default", "w", "main")}})
    republished: list[int] = []
    annotator.annotate(client(api, short_tmp), held, lambda: republished.append(1))
    assert annotation(api, "w") == "GPU-2,GPU-3"
    assert republished == [1]


def test_a_pod_that_is_gone_is_dropped(api: KubeApiDouble, short_tmp: Path) -> None:
    annotator = PodAnnotator(PREFIX, PodSpecBook(PREFIX))
    annotator.shared(Resource.MEMORY, "GPU-1", "GPU-1::0")
    annotator.annotate(
        client(api, short_tmp), records((Resource.MEMORY, "GPU-1::0", "gone")), lambda: None
    )
    assert annotator.handled == 1 and not annotator


def test_an_unnamed_holder_is_tried_again_then_given_up(
    api: KubeApiDouble, short_tmp: Path
) -> None:
    annotator = PodAnnotator(PREFIX, PodSpecBook(PREFIX))
    annotator.shared(Resource.MEMORY, "GPU-1", "GPU-1::0")
    link = client(api, short_tmp)
    for _ in range(POD_ANNOTATION_TRIES - 1):
        annotator.annotate(link, None, lambda: None)
        assert annotator and annotator.handled == 0
    annotator.annotate(link, None, lambda: None)
    assert not annotator and annotator.handled == 1


def test_what_is_left_is_kept_when_the_api_server_fails(
    api: KubeApiDouble, short_tmp: Path
) -> None:
    pod(api, "a")
    annotator = PodAnnotator(PREFIX, PodSpecBook(PREFIX))
    annotator.shared(Resource.MEMORY, "GPU-1", "GPU-1::0")
    held = records((Resource.MEMORY, "GPU-1::0", "a"))
    link = client(api, short_tmp)
    api.fail_next(1, 503, "/pods/a")
    with pytest.raises(ApiStatusError):
        annotator.annotate(link, held, lambda: None)
    assert annotator and annotation(api, "a") is None
    annotator.annotate(link, held, lambda: None)
    assert annotation(api, "a") == "GPU-1" and not annotator
