"""``podslim.claim_view``: what the pod watch keeps of a pod that uses ResourceClaims.

The DRA driver takes which claims share a container from the watch's copy instead of
reading the pod (``dra/mates.py``), so the copy must read exactly as the whole object
would, or not be kept at all (then the pod is read): a property over any object, the
API server's shapes and hostile ones alike.
"""

from __future__ import annotations

from typing import Any

from hypothesis import event, given, settings
from hypothesis import strategies as st

from gpushare.dra.mates import MatesUnknown, claims_by_container
from gpushare.kube.podslim import MAX_CLAIM_ENTRIES, claim_view
from gpushare.sim.drakubeletdouble import pod_using_claims


def _read(pod: Any) -> dict[str, frozenset[str]] | str:
    try:
        return claims_by_container(pod)
    except MatesUnknown as exc:
        return f"unknown: {exc}"


def test_a_pod_using_claims_is_kept_as_its_claims_and_nothing_else() -> None:
    pod = pod_using_claims("ns", "p", "node", {"a": ["one", "two"]}, templates={"two": "gen"})
    pod["metadata"]["uid"] = "u1"
    pod["metadata"]["annotations"] = {"big": "x" * 100_000}
    pod["spec"]["containers"][0]["env"] = [{"name": "A", "value": "y" * 100_000}]
    view = claim_view(pod)
    assert view is not None
    assert view["metadata"] == {"uid": "u1", "namespace": "ns", "name": "p"}
    assert "env" not in str(view) and len(str(view)) < 1000
    assert _read(view) == _read(pod) == {"a": frozenset({"one", "two"})}


def test_terminal_pods_pods_without_claims_and_pods_past_the_bounds_are_not_kept() -> None:
    pod = pod_using_claims("ns", "p", "node", {"a": ["one"]})
    assert claim_view(pod) is not None
    assert claim_view({**pod, "status": {"phase": "Succeeded"}}) is None
    assert claim_view({"metadata": {}, "spec": {"containers": [{"name": "a"}]}}) is None
    many = [{"name": f"pc-{i}", "resourceClaimName": f"c{i}"} for i in range(MAX_CLAIM_ENTRIES)]
    assert claim_view({**pod, "spec": {**pod["spec"], "resourceClaims": many}}) is None
    assert claim_view({**pod, "spec": {**pod["spec"], "resourceClaims": [{"name": 7}]}}) is None


_KEYS = [
    "spec",
    "status",
    "phase",
    "containers",
    "initContainers",
    "resources",
    "claims",
    "name",
    "resourceClaims",
    "resourceClaimName",
    "resourceClaimTemplateName",
    "resourceClaimStatuses",
    "extendedResourceClaimStatus",
    "requestMappings",
    "containerName",
]


@settings(max_examples=300)
@given(
    st.recursive(
        st.none() | st.integers() | st.sampled_from(["a", "b", "pc-a", "Failed", "x" * 300]),
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), inner, max_size=5)
        ),
        max_leaves=30,
    )
)
def test_a_kept_view_reads_as_the_whole_object(pod: Any) -> None:
    """Any object: the view is None or tells the same claims per container (or the same
    "cannot tell") as the object it was cut from."""
    if not isinstance(pod, dict):
        pod = {"spec": pod}
    view = claim_view(pod)
    event("kept" if view is not None else "not kept")
    if view is not None:
        assert _read(view) == _read(pod)


@st.composite
def _pods(draw: st.DrawFn) -> dict[str, Any]:
    """Pods as the API server holds them, some mid-way (a template's claim not named
    yet), with an extended resource's claim, and some with one value of a wrong type."""
    claims = ["one", "two", "three"]
    containers = draw(
        st.dictionaries(
            st.sampled_from(["a", "b", "c"]), st.lists(st.sampled_from(claims), max_size=3)
        )
    )
    templated = draw(st.lists(st.sampled_from(claims), unique=True))
    pod = pod_using_claims(
        "ns", "p", "node", containers, templates={c: f"t-{c}" for c in templated}
    )
    statuses = pod["status"]["resourceClaimStatuses"]
    del statuses[: draw(st.integers(0, len(statuses)))]  # not named yet
    if draw(st.booleans()):
        pod["status"]["extendedResourceClaimStatus"] = {
            "resourceClaimName": "p-extended",
            "requestMappings": [
                {"containerName": n, "resourceName": "gpushare.io/gpu", "requestName": "r"}
                for n in draw(st.lists(st.sampled_from(["a", "b", "z"])))
            ],
        }
    if draw(st.booleans()):  # one value of a wrong type somewhere
        spots = [*pod["spec"]["resourceClaims"], *statuses, *pod["spec"]["containers"]]
        if spots:
            spot = draw(st.sampled_from(spots))
            spot[draw(st.sampled_from(sorted(spot)))] = draw(st.integers() | st.just(["x"]))
    return pod


@given(_pods())
def test_a_kept_view_of_a_pod_reads_as_the_pod(pod: dict[str, Any]) -> None:
    view = claim_view(pod)
    event("kept" if view is not None else "not kept")
    if view is not None:
        assert _read(view) == _read(pod)
