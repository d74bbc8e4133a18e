"""Hostile bodies: a 4xx with a JSON message, never a 5xx; work linear in the body.

Over real HTTP for the cases seen (5 MB of nested ``[``, 5000-digit and ``"²"``
quantities, bodies over the bound), and through the pure verbs for hypothesis'
arbitrary JSON put where the scheduler's objects go.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from kit.extender import (
    MEMORY,
    RunningExtender,
    args,
    card,
    container,
    extender,
    extender_factory,
    get,
    kept,
    node,
    pod,
)
from kit.sizes import at_two_sizes

from gpushare.extender import verbs
from gpushare.extender.body import BadRequest, nesting_depth, parse_json
from gpushare.extender.httpserver import PROBES, ExtenderSettings, build_app
from gpushare.extender.ledger import AdmissionLedger
from gpushare.extender.verbs import BindRefused, ExtenderPolicy, ExtenderState

__all__ = ["extender", "extender_factory"]  # fixtures

VERBS = ("filter", "prioritize", "bind")


def quantity_pod(value: Any) -> dict[str, Any]:
    return pod("q", {"name": "main", "resources": {"limits": {MEMORY: value}}})


HOSTILE = [
    pytest.param(b"[" * 3_000_000, "nests", id="3 MB of nested ["),
    pytest.param(b'{"a":' * 100 + b"1" + b"}" * 100, "nests", id="100 nested objects"),
    pytest.param(b'{"Pod": {"x": 1' + b"0" * 5000 + b"}}", "too long", id="5000-digit number"),
    pytest.param(b'{"Pod": NaN}', "NaN is not JSON", id="NaN"),
    pytest.param(b'{"Pod": 1e999}', "out of range", id="1e999"),
    pytest.param(b"   ", "empty", id="blank"),
    pytest.param(b"\xff", "not UTF-8", id="not UTF-8"),
    pytest.param(
        json.dumps(args(quantity_pod("9" * 5000), node("a", [card(0)]))).encode(),
        "whole number of units",
        id="5000-digit quantity",
    ),
    pytest.param(
        json.dumps(args(quantity_pod("²"), node("a", [card(0)]))).encode(),
        "whole number of units",
        id="superscript-two quantity",
    ),
    pytest.param(
        json.dumps(args(quantity_pod("٣"), node("a", [card(0)]))).encode(),
        "whole number of units",
        id="Arabic-Indic digit",
    ),
    pytest.param(
        json.dumps(args(quantity_pod([1]), node("a", [card(0)]))).encode(),
        "whole number of units",
        id="quantity of the wrong type",
    ),
]


@pytest.mark.parametrize(("raw", "message"), HOSTILE)
def test_hostile_bodies_get_400_with_a_json_message(
    extender_factory: Callable[..., RunningExtender], raw: bytes, message: str
) -> None:
    server = extender_factory(max_body_bytes=8 << 20)
    for verb in ("filter", "prioritize"):
        status, answer = server.post(verb, None, raw=raw)
        assert status == 400, (verb, answer)
        assert message in answer["Error"]
    status, answer = server.post("bind", None, raw=raw)
    assert status == 400
    # Still serving.
    ok = args(pod("ok", container("main", memory=1)), node("a", [card(0)]))
    assert kept(server.filter(ok)) == ["a"]


def test_a_body_over_the_bound_is_413_and_the_default_bound_is_4_mib(
    extender: RunningExtender,
) -> None:
    assert extender.settings.max_body_bytes == 4 << 20
    padding = "x" * (4 << 20)
    status, answer = extender.post("filter", {"Pod": {}, "pad": padding})
    assert status == 413
    assert "larger than 4194304 bytes" in answer["Error"]
    status, _ = extender.post("filter", args(pod("ok", container("c", memory=1)), node("a")))
    assert status == 200


def test_a_bad_annotation_costs_only_its_own_node(extender: RunningExtender) -> None:
    key = "gpushare.io/gpus"
    good = node("good", [card(0)])
    bad = [node(f"bad{i}", [card(0)]) for i in range(5)]
    nested = "[" * 100_000
    huge = json.dumps({"version": 1, "generation": 1, "memoryUnitMiB": 256, "gpus": [
        {"uuid": "G", "index": 0, "name": "x", "memory_mib": 1, "memory_units": 10**40,
         "memory_units_used": 0, "core_units": 100, "core_units_used": 0, "healthy": True}
    ]})  # fmt: skip
    negative = huge.replace(str(10**40), "-5")
    for target, text in zip(bad, [nested, huge, negative, "{", '"x"'], strict=True):
        target["metadata"]["annotations"][key] = text
    bad[4]["metadata"]["annotations"][key] = 5  # not even a string
    answer = extender.filter(args(pod("p", container("main", memory=1)), good, *bad))
    assert kept(answer) == ["good"]
    assert set(answer["FailedNodes"]) == {f"bad{i}" for i in range(5)}
    status, scores = extender.post("prioritize", args(pod("p", container("m", memory=1)), *bad))
    assert status == 200 and {s["Score"] for s in scores} == {0}


def test_metrics_and_readyz(extender: RunningExtender) -> None:
    assert get(extender, "/readyz") == (200, "ok\n")
    extender.filter(args(pod("p", container("main", memory=1)), node("a", [card(0)]), node("b")))
    extender.post("filter", None, raw=b"{")
    status, text = get(extender, "/metrics")
    assert status == 200
    assert 'gpushare_extender_requests_total{code="200",verb="filter"} 1.0' in text
    assert 'gpushare_extender_requests_total{code="400",verb="filter"} 1.0' in text
    assert 'gpushare_extender_node_verdicts_total{reason="fits"} 1.0' in text
    assert 'gpushare_extender_node_verdicts_total{reason="no_annotation"} 1.0' in text
    assert 'gpushare_extender_request_seconds_count{verb="filter"} 2.0' in text
    assert "gpushare_extender_ledger_holds 0.0" in text
    assert "gpushare_extender_pods_awaiting_binding 1.0" in text


# -- the pure verbs under hypothesis ---------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)


def _with(base: Any, path: tuple[str, ...], value: Any) -> Any:
    """``base`` with the value at ``path`` replaced (creating objects on the way)."""
    if not path:
        return value
    result = dict(base) if isinstance(base, dict) else {}
    result[path[0]] = _with(result.get(path[0]), path[1:], value)
    return result


PLACES = [
    (),
    ("Pod",),
    ("Pod", "metadata"),
    ("Pod", "metadata", "uid"),
    ("Pod", "spec"),
    ("Pod", "spec", "containers"),
    ("Pod", "spec", "initContainers"),
    ("Nodes",),
    ("Nodes", "items"),
    ("NodeNames",),
]


def _valid_body() -> dict[str, Any]:
    the_pod = pod("p", container("a", memory=2, core=10), container("b", memory=1))
    return args(the_pod, node("n0", [card(0), card(1, 4)]), node("n1", [card(0, 15)]))


@at_two_sizes(
    given(place=st.sampled_from(PLACES), value=json_values, spot=st.integers(0, 40)),
    quick=80,
    full=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
def test_any_json_anywhere_is_an_answer_or_a_bad_request(
    place: tuple[str, ...], value: Any, spot: int
) -> None:
    body = _with(_valid_body(), place, value)
    # Also a spot inside a container or a node (resources, annotations, status).
    inner = [
        ("Pod", "spec", "containers", 0, "resources"),
        ("Pod", "spec", "containers", 0, "resources", "limits", MEMORY),
        ("Nodes", "items", 0, "metadata"),
        ("Nodes", "items", 0, "metadata", "annotations"),
        ("Nodes", "items", 0, "metadata", "annotations", "gpushare.io/gpus"),
        ("Nodes", "items", 1, "status"),
        ("Nodes", "items", 1, "metadata", "name"),
    ]
    if spot < len(inner) and not place:
        body = _valid_body()
        target: Any = body
        *way, last = inner[spot]
        for step in way:
            target = target[step]
        target[last] = value
    state = ExtenderState(AdmissionLedger(60))
    policy = ExtenderPolicy()
    for verb in (verbs.filter_verb, verbs.prioritize_verb):
        try:
            answer = verb(body, policy, state)
        except BadRequest as exc:
            assert str(exc)
            continue
        json.dumps(answer)  # an answer is always serialisable
    with contextlib.suppress(BadRequest, BindRefused):
        verbs.bind_verb(value, policy, state)


@given(text=st.text(alphabet='[]{}"\\ab,:', max_size=60))
def test_nesting_depth_counts_brackets_outside_strings(text: str) -> None:
    try:
        parsed = json.loads(text)
    except (ValueError, RecursionError):
        return

    def depth(value: Any) -> int:
        if isinstance(value, list):
            return 1 + max(map(depth, value), default=0)
        if isinstance(value, dict):
            return 1 + max(map(depth, value.values()), default=0)
        return 0

    assert nesting_depth(text) == depth(parsed)
    assert parse_json(text.encode()) == parsed


# -- linear work -------------------------------------------------------------------------


def _lines_run(call: Callable[[], object]) -> int:
    """Python lines executed by ``call`` (a deterministic measure of its work)."""
    count = 0

    def tracer(frame: FrameType, event: str, _arg: object) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return tracer

    gc.collect()  # no finalizer of an earlier test may run (and count) inside
    gc.disable()
    sys.settrace(tracer)
    try:
        call()
    finally:
        sys.settrace(None)
        gc.enable()
    return count


def test_filter_work_is_linear_in_nodes_and_ignores_holds_elsewhere() -> None:
    policy = ExtenderPolicy()

    def work(nodes: int, holds_elsewhere: int) -> int:
        ledger = AdmissionLedger(60)
        for i in range(holds_elsewhere):
            ledger.record(f"held-{i}", f"other-{i}", 1, {"GPU-x": (1, 0)})
        state = ExtenderState(ledger)
        body = args(
            pod("p", container("main", memory=1)),
            *(node(f"n{i}", [card(0, 3), card(1)]) for i in range(nodes)),
        )
        return _lines_run(lambda: verbs.filter_verb(body, policy, state))

    work(100, 1)  # first calls fill caches (regular expressions, enum lookups)
    base = work(100, 1)
    assert work(100, 2000) == base  # unrelated holds cost nothing
    assert work(400, 1) <= 4.1 * base  # four times the nodes, four times the work


def test_the_probe_listener_serves_probes_and_metrics_only() -> None:
    app = build_app(ExtenderSettings(probe_port=9447))
    probes = {(r.method, r.resource.canonical) for r in app[PROBES].router.routes() if r.resource}
    assert probes == {
        (method, path) for path in ("/healthz", "/readyz", "/metrics") for method in ("GET", "HEAD")
    }
    verbs_served = {
        r.resource.canonical for r in app.router.routes() if r.method == "POST" and r.resource
    }
    assert verbs_served == {"/gpushare/filter", "/gpushare/prioritize", "/gpushare/bind"}
