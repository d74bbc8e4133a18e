"""The admission policies' CEL, evaluated offline by a real CEL implementation.

cel-python (``celpy``) runs each expression the way the API server runs a
ValidatingAdmissionPolicy: match constraints, match conditions, variables in order,
then every validation; an expression that errors denies (failurePolicy: Fail). The
functions of Kubernetes' CEL libraries the policies use, ``list.join(sep)`` and the
quantity library's ``quantity(s)``, ``isGreaterThan``, ``isInteger`` and ``asInteger``, are
provided here (cel-python
has none of them); the API server's own evaluation belongs to the e2e suite. Verdicts
are checked against allowed and forbidden requests, and against a plain-Python
statement of the rule for random changes (hypothesis).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from copy import deepcopy
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy import celtypes
from hypothesis import given, settings
from hypothesis import strategies as st
from kit.sizes import at_two_sizes
from test_deploy_manifests import chart_objects

from gpushare.gpu import mig
from gpushare.kube import nodestate
from gpushare.kube.labels import NVIDIA_PRODUCT_LABEL

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ROOT / "daemonset" / "policies"
DAEMON = "system:serviceaccount:kube-system:gpushare"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"


def _join(items: Any, separator: Any) -> celtypes.StringType:
    return celtypes.StringType(str(separator).join(str(item) for item in items))


# Kubernetes' quantity library (k8s.io/apiserver/pkg/cel/library/quantity.go, from 1.28),
# the part the policies use: quantity(string) and Quantity.isGreaterThan(Quantity). The
# grammar is resource.Quantity's: a signed decimal number, then a binary-SI suffix
# (Ki..Ei), a decimal-SI suffix (n u m "" k M G T P E) or a decimal exponent (e3, E-2).
# The real API server's evaluation belongs to the e2e suite; this double is exact for
# the values a pod spec can carry.
_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<binary>[KMGTPE]i)|(?P<exponent>[eE][+-]?[0-9]+)|(?P<decimal>[numkMGTPE]?))$"
)
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


class Quantity(celtypes.StringType):
    """A parsed quantity: the string as written, and its exact value."""

    value: Fraction


def _quantity(text: Any) -> Quantity:
    match = _QUANTITY.match(str(text))
    if match is None:
        raise ValueError(f"quantities must match the regular expression: {text!r}")
    number = Fraction(match["number"])
    if match["binary"]:
        number *= 1024 ** _BINARY[match["binary"]]
    elif match["exponent"]:
        number *= Fraction(10) ** int(match["exponent"][1:])
    else:
        number *= Fraction(10) ** _DECIMAL[match["decimal"]]
    quantity = Quantity(str(text))
    quantity.value = number
    return quantity


def _is_greater_than(left: Any, right: Any) -> celtypes.BoolType:
    if not isinstance(left, Quantity) or not isinstance(right, Quantity):
        raise TypeError("isGreaterThan needs two quantities")
    return celtypes.BoolType(left.value > right.value)


INT64_MAX = (1 << 63) - 1


def _is_integer(q: Any) -> celtypes.BoolType:
    """Quantity.isInteger(): whether it is an int64 without loss."""
    if not isinstance(q, Quantity):
        raise TypeError("isInteger needs a quantity")
    return celtypes.BoolType(q.value.denominator == 1 and -INT64_MAX - 1 <= q.value <= INT64_MAX)


def _as_integer(q: Any) -> celtypes.IntType:
    """Quantity.asInteger(): an error where isInteger() is false."""
    if not _is_integer(q):
        raise ValueError(f"cannot convert value to integer: {q}")
    return celtypes.IntType(int(q.value))


FUNCTIONS = {"join": _join, "quantity": _quantity, "isGreaterThan": _is_greater_than,
             "isInteger": _is_integer, "asInteger": _as_integer}  # fmt: skip


@dataclass
class Policy:
    """A compiled ValidatingAdmissionPolicy (or the match part of a mutating one)."""

    spec: dict[str, Any]

    def __post_init__(self) -> None:
        env = celpy.Environment()

        def compile_(text: str) -> Callable[[dict[str, Any]], Any]:
            program = env.program(env.compile(text), functions=FUNCTIONS)
            return program.evaluate  # type: ignore[no-any-return]

        self.conditions = [compile_(c["expression"]) for c in self.spec.get("matchConditions", [])]
        self.variables = [
            (v["name"], compile_(v["expression"])) for v in self.spec.get("variables", [])
        ]
        self.validations = [
            (
                compile_(v["expression"]),
                v.get("message"),
                v.get("messageExpression") and compile_(v["messageExpression"]),
            )
            for v in self.spec.get("validations", [])
        ]

    def matches(self, request: dict[str, Any]) -> bool:
        for rule in self.spec["matchConstraints"]["resourceRules"]:
            if (
                request["resource"]["resource"] in rule["resources"]
                and request["operation"] in rule["operations"]
            ):
                return True
        return False

    def _activation(self, request: dict[str, Any], obj: Any, old: Any) -> dict[str, Any]:
        return {
            "request": celpy.json_to_cel(request),
            "object": celpy.json_to_cel(obj),
            "oldObject": celpy.json_to_cel(old),
        }

    def conditions_hold(self, request: dict[str, Any], obj: Any, old: Any = None) -> bool:
        activation = self._activation(request, obj, old)
        return all(bool(condition(activation)) for condition in self.conditions)

    def denials(self, request: dict[str, Any], obj: Any, old: Any = None) -> list[str] | None:
        """None if the policy does not apply; else the messages of the failed validations."""
        if not self.matches(request) or not self.conditions_hold(request, obj, old):
            return None
        activation = self._activation(request, obj, old)
        values: dict[celtypes.StringType, Any] = {}
        activation["variables"] = celtypes.MapType(values)
        denied = []
        for name, variable in self.variables:
            values[celtypes.StringType(name)] = variable(activation)
            activation["variables"] = celtypes.MapType(values)
        for expression, message, message_expression in self.validations:
            try:
                verdict = expression(activation)
            except celpy.CELEvalError as exc:
                denied.append(f"expression error: {exc.args[0]}")
                continue
            if verdict is not True and verdict != celtypes.BoolType(True):
                denied.append(
                    str(message_expression(activation)) if message_expression else message
                )
        return denied


def _load(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    policy, binding = yaml.safe_load_all((POLICIES / name).read_text())
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    return policy, binding


CORE = Policy(_load("core-needs-memory.yaml")[0]["spec"])
SCOPE = Policy(_load("daemon-node-scope.yaml")[0]["spec"])


# -- core without memory ---------------------------------------------------------------


def _pod(*containers: dict[str, Any], init: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers)}
    if init:
        spec["initContainers"] = list(init)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": spec}


def _c(name: str, **limits: int) -> dict[str, Any]:
    names = {"memory": "gpushare.io/vcuda-memory", "core": "gpushare.io/vcuda-core", "cpu": "cpu"}
    return {"name": name, "resources": {"limits": {names[k]: str(v) for k, v in limits.items()}}}


CREATE_POD = {"operation": "CREATE", "resource": {"group": "", "version": "v1", "resource": "pods"}}


@pytest.mark.parametrize(
    ("pod", "denied"),
    [
        (_pod(_c("a", memory=4, core=30)), []),
        (_pod(_c("a", memory=4)), []),
        (_pod(_c("a", cpu=1)), []),
        (_pod({"name": "bare"}), []),
        (_pod({"name": "empty", "resources": {}}), []),
        (_pod(_c("a", memory=4), _c("b", core=50)), ["b"]),
        (_pod(_c("a", core=50), _c("b", core=10, cpu=1)), ["a, b"]),
        (_pod(_c("a", memory=1), init=(_c("setup", core=100),)), ["setup"]),
        # vcuda-memory: 0 is no memory: the kubelet skips it and only the core Allocate
        # reaches the daemon. vcuda-core: 0 asks nothing.
        (_pod(_c("a", memory=0, core=50)), ["a"]),
        (_pod(_c("a", memory=4, core=50), _c("b", core=10, memory=0)), ["b"]),
        (_pod(_c("a", memory=0, core=0)), []),
        (_pod(_c("a", core=0)), []),
    ],
)
def test_a_pod_asking_cores_without_memory_is_refused_with_what_to_add(
    pod: dict[str, Any], denied: list[str]
) -> None:
    messages = CORE.denials(CREATE_POD, pod)
    assert messages is not None
    assert [m.split("container(s) ", 1)[1].split(" ask for")[0] for m in messages] == denied
    for message in messages:
        assert message.endswith("add gpushare.io/vcuda-memory of 1 or more")


@pytest.mark.parametrize(
    ("limits", "said"),
    [
        ({"core": 150, "memory": 4}, "more than 100 gpushare.io/vcuda-core (a asks 150)"),
        ({"memory": "4Gi"}, "a: 4Gi is 4294967296 units of 256 MiB; did you mean 16?"),
        ({"memory": 3000}, "a: 3000 is 3000 units of 256 MiB; did you mean 12?"),
        ({"memory": 4294967296}, "a: 4294967296 is 4294967296 units of 256 MiB; did you mean 16?"),
        ({"memory": "2049"}, "a: 2049 is 2049 units of 256 MiB; did you mean 9?"),
        ({"memory": "9Ei"}, "a: 9Ei is more units than any card holds"),
    ],
)
def test_a_quantity_no_container_can_mean_is_refused_with_the_unit(
    limits: dict[str, Any], said: str
) -> None:
    """Issue 33.4: 150 core units, or memory written in MiB or bytes, was admitted and then
    failed ("no single card had 150 free units") or stayed Pending for ever."""
    messages = CORE.denials(CREATE_POD, _pod(_c("a", **limits)))
    assert messages is not None and len(messages) == 1, messages
    assert said in messages[0]
    if "memory" in said:
        assert messages[0].endswith("it counts units of 256 MiB, not MiB or bytes")


@pytest.mark.parametrize("limits", [{"core": 100, "memory": 2048}, {"memory": 1}, {"core": 0}])
def test_the_largest_sensible_quantities_pass(limits: dict[str, int]) -> None:
    assert CORE.denials(CREATE_POD, _pod(_c("a", **limits))) == []


@given(units=st.integers(min_value=0, max_value=1 << 40), cores=st.integers(0, 1000))
@settings(max_examples=60, deadline=None)
def test_quantities_are_refused_exactly_beyond_a_card(units: int, cores: int) -> None:
    """512 GiB of 256 MiB units (2048) and 100 core units: refused beyond, never within;
    the suggestion is the figure read as MiB (or as bytes from 1 Mi up), rounded up."""
    messages = CORE.denials(CREATE_POD, _pod(_c("a", memory=max(units, 1), core=cores))) or []
    units = max(units, 1)
    assert any("vcuda-core (" in m for m in messages) is (cores > 100)
    memory = [m for m in messages if "vcuda-memory than" in m]
    assert bool(memory) is (units > 2048)
    if memory:
        mib = 256 * (1 << 20) if units >= 1 << 20 else 256
        assert f"did you mean {-(-units // mib)}?" in memory[0]


def test_the_charts_policy_follows_the_unit_size_and_the_prefix() -> None:
    values = {"config": {"memoryUnitMib": 1024, "resourcePrefix": "example.com"}}
    (spec,) = [
        o["spec"]
        for o in chart_objects(values)
        if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"].endswith("memory")
    ]
    policy = Policy(spec)
    pod = _pod(_limits("a", **{"example.com/vcuda-memory": "4Gi"}))
    (message,) = policy.denials(CREATE_POD, pod) or [""]
    assert "a: 4Gi is 4294967296 units of 1024 MiB; did you mean 4?" in message
    assert "more example.com/vcuda-memory than" in message
    assert policy.denials(CREATE_POD, _pod(_limits("a", **{"example.com/vcuda-memory": 512}))) == []
    assert policy.denials(CREATE_POD, _pod(_limits("a", **{"example.com/vcuda-memory": 513})))


def test_the_core_policy_looks_only_at_new_pods() -> None:
    update = {**CREATE_POD, "operation": "UPDATE"}
    assert CORE.denials(update, _pod(_c("a", core=50))) is None


# -- the daemon's reach -----------------------------------------------------------------


def _request(
    resource: str, name: str, user: str = DAEMON, node: str | None = "n1"
) -> dict[str, Any]:
    extra = {NODE_NAME_KEY: [node]} if node else {}
    return {
        "operation": "UPDATE",
        "name": name,
        "resource": {"group": "", "version": "v1", "resource": resource},
        "userInfo": {"username": user, "groups": ["system:serviceaccounts"], "extra": extra},
    }


def _node(name: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/hostname": name, "gpushare.io/enabled": "true"},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", "gpushare.io/gpus": "{}"},
        },
        "spec": {"podCIDR": "10.0.0.0/24"},
    }


def _gpu_pod(node: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [_c("main", memory=4)]}
    if node:
        spec["nodeName"] = node
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "w", "namespace": "t", "labels": {"app": "w"}, "annotations": {}},
        "spec": spec,
    }


def _changed(obj: dict[str, Any], change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    new = deepcopy(obj)
    change(new)
    return new


def _set(*path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(obj: dict[str, Any]) -> None:
        target = obj
        for step in path[:-1]:
            target = target.setdefault(step, {})
        if value is None:
            target.pop(path[-1], None)
        else:
            target[path[-1]] = value

    return change


GPUS = "gpushare.io/gpus"
ALLOWED = [
    ("nodes", "n1", _node("n1"), _set("metadata", "annotations", GPUS, value='{"v":2}')),
    ("nodes", "n1", _node("n1"), _set("metadata", "labels", "gpushare.io/gpu.count", value="2")),
    ("nodes", "n1", _node("n1"), _set("metadata", "annotations", GPUS, value=None)),
    (
        "pods",
        "w",
        _gpu_pod("n1"),
        _set("metadata", "annotations", "gpushare.io/gpu.main", value="x"),
    ),
]
FORBIDDEN = [
    (
        "nodes",
        "n2",
        _node("n2"),
        _set("metadata", "annotations", GPUS, value="{}x"),
        "its own Node",
    ),
    ("nodes", "n1", _node("n1"), _set("spec", "unschedulable", value=True), "only annotations"),
    (
        "nodes",
        "n1",
        _node("n1"),
        _set("spec", "taints", value=[{"key": "k", "effect": "NoSchedule"}]),
        "only annotations",
    ),
    (
        "nodes",
        "n1",
        _node("n1"),
        _set("metadata", "annotations", "other.io/x", value="1"),
        "annotations",
    ),
    (
        "nodes",
        "n1",
        _node("n1"),
        _set("metadata", "annotations", "node.alpha.kubernetes.io/ttl", value=None),
        "annotations",
    ),
    (
        "nodes",
        "n1",
        _node("n1"),
        _set("metadata", "labels", "gpushare.io/enabled", value=None),
        "labels",
    ),
    (
        "nodes",
        "n1",
        _node("n1"),
        _set("metadata", "labels", "kubernetes.io/hostname", value="evil"),
        "labels",
    ),
    (
        "pods",
        "w",
        _gpu_pod("n2"),
        _set("metadata", "annotations", "gpushare.io/gpu.main", value="x"),
        "pods on its own node",
    ),
    (
        "pods",
        "w",
        _gpu_pod(None),
        _set("metadata", "annotations", "gpushare.io/gpu.main", value="x"),
        "pods on its own node",
    ),
    (
        "pods",
        "w",
        _gpu_pod("n1"),
        _set("metadata", "annotations", "gpushare.io/other", value="x"),
        "annotations",
    ),
    ("pods", "w", _gpu_pod("n1"), _set("metadata", "labels", "app", value="other"), "labels"),
    (
        "pods",
        "w",
        _gpu_pod("n1"),
        _set("metadata", "finalizers", value=["x/y"]),
        "only annotations",
    ),
    (
        "pods",
        "w",
        _gpu_pod("n1"),
        _set("metadata", "ownerReferences", value=[{"name": "o"}]),
        "only annotations",
    ),
]


@pytest.mark.parametrize(("resource", "name", "old", "change"), ALLOWED)
def test_the_daemon_may_change_its_own_keys_on_its_own_node(
    resource: str, name: str, old: dict[str, Any], change: Callable[[dict[str, Any]], None]
) -> None:
    assert SCOPE.denials(_request(resource, name), _changed(old, change), old) == []


@pytest.mark.parametrize(("resource", "name", "old", "change", "message"), FORBIDDEN)
def test_the_daemon_may_change_nothing_else(
    resource: str,
    name: str,
    old: dict[str, Any],
    change: Callable[[dict[str, Any]], None],
    message: str,
) -> None:
    denials = SCOPE.denials(_request(resource, name), _changed(old, change), old)
    assert denials and any(message in d for d in denials), denials


def test_a_token_without_the_node_name_is_refused_and_other_users_are_not_matched() -> None:
    old = _node("n1")
    new = _changed(old, _set("metadata", "annotations", GPUS, value="{}"))
    denials = SCOPE.denials(_request("nodes", "n1", node=None), new, old)
    assert denials and "carries no node name" in denials[0]
    assert SCOPE.denials(_request("nodes", "n1", user="system:node:n1"), new, old) is None
    admin = _request("nodes", "n2", user="kubernetes-admin")
    assert (
        SCOPE.denials(admin, _changed(old, _set("spec", "unschedulable", value=True)), old) is None
    )


def _daemon_label(key: str) -> bool:
    return (key.startswith("gpushare.io/") and key != "gpushare.io/enabled") or (
        key == NVIDIA_PRODUCT_LABEL
    )


KEYS = [
    NVIDIA_PRODUCT_LABEL,
    "gpushare.io/gpus",
    "gpushare.io/gpu.main",
    "gpushare.io/gpu.count",
    "gpushare.io/enabled",
    "other.io/x",
]


@at_two_sizes(
    given(
        resource=st.sampled_from(["nodes", "pods"]),
        where=st.sampled_from(["n1", "n2", None]),
        annotation_changes=st.dictionaries(
            st.sampled_from(KEYS), st.one_of(st.none(), st.sampled_from(["a", "b"])), max_size=3
        ),
        label_changes=st.dictionaries(
            st.sampled_from(KEYS), st.one_of(st.none(), st.sampled_from(["a", "b"])), max_size=2
        ),
        spec_change=st.booleans(),
    ),
    quick=40,
    full=150,
    deadline=None,
)
def test_the_daemon_scope_agrees_with_the_rule_in_plain_words(
    resource: str,
    where: str | None,
    annotation_changes: dict[str, str | None],
    label_changes: dict[str, str | None],
    spec_change: bool,
) -> None:
    if resource == "nodes":
        old, name, own = _node(where or "n2"), where or "n2", where == "n1"
    else:
        old, name, own = _gpu_pod(where), "w", where == "n1"
    new = deepcopy(old)
    for field, changes in (("annotations", annotation_changes), ("labels", label_changes)):
        for key, value in changes.items():
            _set("metadata", field, key, value=value)(new)
    if spec_change:
        new["spec"]["priority"] = 7
    meta_old, meta_new = old["metadata"], new["metadata"]

    def changed_keys(field: str) -> set[str]:
        before, after = meta_old.get(field, {}), meta_new.get(field, {})
        return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}

    annotation_prefix = "gpushare.io/" if resource == "nodes" else "gpushare.io/gpu."
    label_ok = (
        all(_daemon_label(k) for k in changed_keys("labels"))
        if resource == "nodes"
        else not changed_keys("labels")
    )
    allowed = (
        own
        and all(k.startswith(annotation_prefix) for k in changed_keys("annotations"))
        and label_ok
        and not spec_change
    )
    denials = SCOPE.denials(_request(resource, name), new, old)
    assert denials is not None
    assert (denials == []) == allowed, denials


def test_every_label_the_daemon_writes_is_allowed_on_its_own_node() -> None:
    """Derived from the code: the labels node.py publishes (gpu.*, cuda.driver.*, the
    GFD product label) and those of MIG (mig.strategy, mig-<profile>.*)."""
    mig_keys = ["gpushare.io/mig.strategy", "gpushare.io/mig-1g.5gb.count"]
    assert all(mig.is_label("gpushare.io", key) for key in mig_keys)
    keys = [*nodestate.label_keys("gpushare.io"), NVIDIA_PRODUCT_LABEL, *mig_keys]
    old = _node("n1")
    new = _changed(old, lambda n: n["metadata"]["labels"].update(dict.fromkeys(keys, "1")))
    assert SCOPE.denials(_request("nodes", "n1"), new, old) == []
    gone = _changed(new, lambda n: [n["metadata"]["labels"].pop(k) for k in keys])
    assert SCOPE.denials(_request("nodes", "n1"), gone, new) == []


# -- the optional mutating policy's match --------------------------------------------------


def test_only_gpushare_pods_for_the_default_scheduler_get_gpushare_scheduler() -> None:
    policy, _binding = yaml.safe_load_all(
        (ROOT / "daemonset/scheduler/set-scheduler-name.yaml").read_text()
    )
    match = Policy(policy["spec"])
    default = {"schedulerName": "default-scheduler"}

    def sent(pod: dict[str, Any]) -> bool:
        return match.conditions_hold(CREATE_POD, pod)

    assert sent(_pod(_c("a", memory=1)) | {"spec": {"containers": [_c("a", memory=1)], **default}})
    assert sent(
        {"spec": {"containers": [_c("a", cpu=1)], "initContainers": [_c("i", core=5)], **default}}
    )
    assert not sent({"spec": {"containers": [_c("a", cpu=1)], **default}})
    assert not sent({"spec": {"containers": [_c("a", memory=1)], "schedulerName": "volcano"}})


# -- the chart ships the same policies -------------------------------------------------------


def test_chart_policies_are_the_kustomize_ones_and_can_be_turned_off() -> None:
    rendered = {
        (o["kind"], o["metadata"]["name"]): o
        for o in chart_objects()
        if o["kind"].startswith("ValidatingAdmissionPolicy")
    }
    for name in ("core-needs-memory.yaml", "daemon-node-scope.yaml"):
        for obj in _load(name):
            assert rendered[(obj["kind"], obj["metadata"]["name"])]["spec"] == obj["spec"]
    off = {
        "policies": {
            "coreNeedsMemory": {"enabled": False},
            "daemonNodeScope": {"enabled": False},
            "reservedSettings": {"enabled": False},
        }
    }
    assert not [o for o in chart_objects(off) if "AdmissionPolicy" in o["kind"]]
    prefixed = [
        o
        for o in chart_objects({"config": {"resourcePrefix": "example.com"}})
        if o["kind"] == "ValidatingAdmissionPolicy"
    ]
    assert prefixed and all(
        "gpushare.io" not in yaml.safe_dump(o["spec"]).replace("gpushare.io/enabled", "")
        for o in prefixed
    )


# -- shared units together with whole cards or MIG devices ---------------------------


def _limits(name: str, **limits: int) -> dict[str, Any]:
    return {"name": name, "resources": {"limits": {k: str(v) for k, v in limits.items()}}}


@pytest.mark.parametrize(
    ("limits", "refused"),
    [
        ({"gpushare.io/gpu": 1, "gpushare.io/vcuda-memory": 4}, True),
        ({"gpushare.io/mig-1g.5gb": 1, "gpushare.io/vcuda-core": 10}, True),
        ({"gpushare.io/gpu": 2}, False),
        ({"gpushare.io/mig-3g.20gb": 1}, False),
        ({"gpushare.io/vcuda-memory": 4, "gpushare.io/vcuda-core": 10}, False),
        ({"nvidia.com/gpu": 1, "gpushare.io/vcuda-memory": 4}, False),  # not ours to judge
    ],
)
def test_a_container_never_mixes_shared_units_with_whole_cards_or_mig(
    limits: dict[str, int], refused: bool
) -> None:
    pod = _pod(_limits("app", **limits))
    denials = CORE.denials(CREATE_POD, pod)
    assert denials is not None
    assert any("together with whole cards or MIG" in d for d in denials) is refused
    # Two containers, one of each kind, are fine.
    split = _pod(
        _limits("a", **{"gpushare.io/gpu": 1}), _limits("b", **{"gpushare.io/vcuda-memory": 4})
    )
    assert not [d for d in CORE.denials(CREATE_POD, split) or [] if "MIG" in d]


# -- installed by default, loudly absent where they cannot be ---------------------------------


def test_the_default_install_applies_the_policies() -> None:
    kustomization = yaml.safe_load((ROOT / "daemonset" / "kustomization.yaml").read_text())
    assert "policies/core-needs-memory.yaml" in kustomization["resources"]
    assert "policies/daemon-node-scope.yaml" in kustomization["resources"]
    assert "policies/reserved-settings.yaml" in kustomization["resources"]
    values = yaml.safe_load((ROOT / "charts" / "gpushare" / "values.yaml").read_text())
    assert values["policies"]["coreNeedsMemory"]["enabled"] is True
    assert values["policies"]["daemonNodeScope"]["enabled"] is True
    assert values["policies"]["reservedSettings"]["enabled"] is True


def test_the_chart_says_loudly_when_a_policy_is_off() -> None:
    from test_deploy_manifests import render_chart

    def notes(values: dict[str, Any] | None = None) -> str:
        return next(v for k, v in render_chart(values).items() if k.endswith("NOTES.txt"))

    assert "WARNING" not in notes()
    off = notes({"policies": {"daemonNodeScope": {"enabled": False}}})
    assert "WARNING" in off and "may patch every Node and" in off
    template = (ROOT / "charts/gpushare/templates/NOTES.txt").read_text()
    assert 'semverCompare ">=1.30.0-0"' in template and "were NOT installed" in template


def test_with_nvidia_mig_names_the_chart_refuses_their_mix_too() -> None:
    """``config.migNvidiaNames``: the daemon serves MIG devices as ``nvidia.com/mig-*``
    (and ``nvidia.com/gpu`` in the single strategy): the chart's policy refuses a
    container mixing those with shared units; without it, they are not ours to judge."""
    values = {"config": {"migNvidiaNames": True}}
    (spec,) = [
        o["spec"]
        for o in chart_objects(values)
        if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"].endswith("memory")
    ]
    policy = Policy(spec)
    for other in ("nvidia.com/mig-1g.5gb", "nvidia.com/gpu", "gpushare.io/mig-1g.5gb"):
        pod = _pod(_limits("app", **{other: 1, "gpushare.io/vcuda-memory": 4}))
        denials = policy.denials(CREATE_POD, pod)
        assert denials is not None
        assert any("together with whole cards or MIG" in d for d in denials), other
    alone = _pod(_limits("app", **{"nvidia.com/mig-1g.5gb": 1}))
    assert policy.denials(CREATE_POD, alone) == []


# -- the daemon's state object (ConfigMap gpushare-node-<node>) -------------------------


def _state_object(name: str, node: str | None, owners: list[tuple[str, str]]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "kube-system"}
    if node is not None:
        meta["annotations"] = {"gpushare.io/node": node}
    if owners:
        meta["ownerReferences"] = [
            {"apiVersion": version, "kind": "Node", "name": owner, "uid": "u"}
            for version, owner in owners
        ]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"gpus": "{}"}}


def _configmap_request(operation: str, name: str) -> dict[str, Any]:
    request = _request("configmaps", name)
    request["operation"] = operation
    return request


@at_two_sizes(
    given(
        operation=st.sampled_from(["CREATE", "UPDATE"]),
        name=st.sampled_from(["gpushare-node-n1", "gpushare-node-n2", "coredns", "gpushare-node-"]),
        node=st.sampled_from(["n1", "n2", None]),
        owners=st.lists(
            st.tuples(st.sampled_from(["v1", "apps/v1"]), st.sampled_from(["n1", "n2"])),
            max_size=2,
        ),
    ),
    quick=50,
    full=200,
    deadline=None,
)
def test_the_daemon_writes_only_its_own_nodes_state_object(
    operation: str, name: str, node: str | None, owners: list[tuple[str, str]]
) -> None:
    """Its token on n1 may create or update only ConfigMap gpushare-node-n1, annotated
    gpushare.io/node: n1 and owned (every owner) by v1 Node n1 and by at least one."""
    obj = _state_object(name, node, owners)
    old = _state_object("gpushare-node-n1", "n1", [("v1", "n1")]) if operation == "UPDATE" else None
    denials = SCOPE.denials(_configmap_request(operation, name), obj, old)
    allowed = (
        name == "gpushare-node-n1"
        and node == "n1"
        and bool(owners)
        and all(owner == ("v1", "n1") for owner in owners)
    )
    assert denials is not None
    assert (denials == []) == allowed, denials
    if not allowed:
        assert any("may write only the ConfigMap gpushare-node-n1" in d for d in denials)


def test_the_state_object_rule_needs_the_tokens_node_and_leaves_others_alone() -> None:
    obj = _state_object("gpushare-node-n1", "n1", [("v1", "n1")])
    request = _configmap_request("CREATE", "gpushare-node-n1")
    request["userInfo"]["extra"] = {}
    denials = SCOPE.denials(request, obj)
    assert denials and any("carries no node name" in d for d in denials)
    admin = _configmap_request("CREATE", "anything")
    admin["userInfo"]["username"] = "kubernetes-admin"
    assert SCOPE.denials(admin, _state_object("anything", None, [])) is None


@pytest.mark.parametrize(
    "name", ["gpushare-node-n1", "gpushare-node-n2", "coredns", "gpushare-node-", "kube-proxy"]
)
def test_the_daemon_deletes_only_its_own_nodes_state_object(name: str) -> None:
    """Issue 41.3: a daemon in ``--node-state annotation`` retires the object it no
    longer writes; its token on n1 may delete ConfigMap gpushare-node-n1 and no other
    (the Role grants delete on every ConfigMap of the namespace)."""
    old = _state_object(name, "n1", [("v1", "n1")])
    denials = SCOPE.denials(_configmap_request("DELETE", name), None, old)
    assert denials is not None
    if name == "gpushare-node-n1":
        assert denials == []
    else:
        only = "the gpushare daemon on n1 may delete only the ConfigMap gpushare-node-n1"
        assert denials == [only]
    admin = _configmap_request("DELETE", name)
    admin["userInfo"]["username"] = "kubernetes-admin"
    assert SCOPE.denials(admin, None, old) is None
