"""A tenant's pod spec cannot change the limits its container gets (issue 32 item 1).

One list (``share/reserved.py``), three readers: the admission policy
``gpushare-reserved-settings`` (kustomize and chart), the daemon's own check at
Allocate, and the CDI mode in which none of it is needed for env. Here: the policy's
CEL is the one generated from the list, and the policy (run by a real CEL
implementation, see test_policies.py) and the daemon's check give the same verdict on
random containers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import TESLA_P4, Node, cards
from hypothesis import given
from hypothesis import strategies as st
from kit.cdi_runtime import final
from kit.sizes import at_two_sizes
from test_deploy_manifests import chart_objects
from test_policies import CREATE_POD, POLICIES, Policy

from gpushare.kube.podslim import slim
from gpushare.share import reserved
from gpushare.sim.kubeletdouble import AdmissionError

ROOT = POLICIES.parent.parent

#: The pod of the issue: 4 memory units, and four lines of env that undid them.
ISSUE_ENV = [
    {"name": "CUDA_DEVICE_MEMORY_LIMIT_0", "value": "99999m"},
    {"name": "CUDA_DEVICE_SM_LIMIT", "value": "100"},
    {"name": "LD_PRELOAD", "value": ""},
    {"name": "CUDA_DISABLE_CONTROL", "value": "true"},
]


def _spec(name: str = "reserved-settings.yaml") -> dict[str, Any]:
    policy, binding = yaml.safe_load_all((POLICIES / name).read_text())
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    return policy["spec"]  # type: ignore[no-any-return]


RESERVED = Policy(_spec())


def _gpu(name: str = "app", **extra: Any) -> dict[str, Any]:
    return {"name": name, "resources": {"limits": {"gpushare.io/vcuda-memory": "4"}}, **extra}


def _pod(*containers: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p"},
        "spec": {"containers": list(containers)},
    }


def _refused(policy: Policy, pod: dict[str, Any]) -> list[str]:
    denials = policy.denials(CREATE_POD, pod)
    assert denials is not None
    return denials


# -- one list ---------------------------------------------------------------------------------


def _variable(spec: dict[str, Any], name: str) -> str:
    (found,) = [v["expression"] for v in spec["variables"] if v["name"] == name]
    return " ".join(str(found).split())


@pytest.mark.parametrize(
    ("variable", "generated"),
    [
        ("setsReserved", reserved.cel_env_reserved("e.name")),
        ("envFromUnsafe", reserved.cel_prefix_unsafe("f.prefix")),
        ("mountsReserved", reserved.cel_path_reserved("m.mountPath")),
    ],
)
def test_the_policy_carries_the_cel_generated_from_the_one_list(
    variable: str, generated: str
) -> None:
    assert generated in _variable(_spec(), variable)
    shipped = yaml.safe_load_all(
        (ROOT / "src/gpushare/manifests/policies/reserved-settings.yaml").read_text()
    )
    assert next(iter(shipped))["spec"] == _spec()


def _chart_policy(values: dict[str, Any] | None = None) -> dict[str, Any] | None:
    for obj in chart_objects(values):
        if obj["kind"] == "ValidatingAdmissionPolicy" and obj["metadata"]["name"].endswith(
            "reserved-settings"
        ):
            return obj["spec"]  # type: ignore[no-any-return]
    return None


#: Every device-list strategy the chart takes (``config.deviceListStrategy``).
STRATEGIES = [
    "envvar",
    "cdi-cri",
    "cdi-annotations",
    "envvar,cdi-cri",
    "cdi-cri,cdi-annotations",
    "envvar,cdi-cri,cdi-annotations",
]
#: Reserved names no grant's CDI spec sets, which HAMi-core still reads: an indexed core
#: limit outranks the un-indexed one the core grant sets (``do_init_device_sm_limits``), and
#: the utilisation policy ``disable`` switches the core limit off.
UNSEALED_ENV = [
    {"name": "CUDA_DEVICE_SM_LIMIT_0", "value": "100"},
    {"name": "GPU_CORE_UTILIZATION_POLICY", "value": "disable"},
]


def test_the_chart_ships_the_same_policy_on_by_default() -> None:
    assert _chart_policy() == _spec()
    kustomization = yaml.safe_load((ROOT / "daemonset" / "kustomization.yaml").read_text())
    assert "policies/reserved-settings.yaml" in kustomization["resources"]
    assert _chart_policy({"policies": {"reservedSettings": {"enabled": False}}}) is None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_chart_keeps_every_rule_under_every_strategy(strategy: str) -> None:
    """A CDI spec replaces only the names it sets: the env rules stay under CDI too (on
    main the chart dropped them there, and a pod setting ``CUDA_DEVICE_SM_LIMIT_0=100`` ran
    unthrottled; nor could a whole card's or MIG device's ``NVIDIA_VISIBLE_DEVICES`` be
    trusted to the seal on nodes whose own strategy is another)."""
    spec = _chart_policy({"config": {"deviceListStrategy": strategy}})
    assert spec == _spec()
    policy = Policy(spec)
    assert _refused(policy, _pod(_gpu(env=ISSUE_ENV)))
    assert _refused(policy, _pod(_gpu(env=UNSEALED_ENV)))
    assert _refused(policy, _pod(_gpu(envFrom=[{"configMapRef": {"name": "c"}}])))
    widen = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
    for resource in ("gpushare.io/gpu", "gpushare.io/mig-1g.5gb", "gpushare.io/vcuda-core"):
        container = {"name": "w", "resources": {"limits": {resource: "1"}}, "env": widen}
        assert _refused(policy, _pod(container)), resource
    assert _refused(
        policy, _pod(_gpu(volumeMounts=[{"name": "v", "mountPath": "/usr/local/vgpu/cache"}]))
    )
    assert _refused(policy, _pod(_gpu(env=[{"name": "APP_MODE", "value": "x"}]))) == []


# -- verdicts -------------------------------------------------------------------------------


def test_the_issue_pod_is_refused_naming_its_container() -> None:
    (message,) = _refused(RESERVED, _pod(_gpu("trainer", env=ISSUE_ENV)))
    assert message.startswith("container(s) trainer set in env a variable gpushare reserves")
    assert reserved.tampering(_gpu(env=ISSUE_ENV)) == (
        "sets CUDA_DEVICE_MEMORY_LIMIT_0, CUDA_DEVICE_SM_LIMIT, CUDA_DISABLE_CONTROL, "
        "LD_PRELOAD in env"
    )


@pytest.mark.parametrize(
    ("container", "refused"),
    [
        (_gpu(env=[{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]), False),
        (_gpu(env=[{"name": "CUDA_DEVICE_MEMORY_LIMIT", "value": "9g"}]), True),
        (_gpu(env=[{"name": "CUDA_DEVICE_SM_LIMIT_1", "value": "100"}]), True),
        (_gpu(env=[{"name": "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", "value": "0=9G"}]), True),
        (_gpu(env=[{"name": "NVIDIA_GPU_MEMORY_LIMIT", "value": "99999"}]), True),
        (_gpu(env=[{"name": "CUDA_REDIRECT", "value": "/tmp/x.so"}]), True),
        (_gpu(envFrom=[{"configMapRef": {"name": "c"}}]), True),
        (_gpu(envFrom=[{"configMapRef": {"name": "c"}, "prefix": "APP_"}]), False),
        (_gpu(envFrom=[{"secretRef": {"name": "c"}, "prefix": "CUDA_"}]), True),
        (_gpu(envFrom=[{"secretRef": {"name": "c"}, "prefix": "CUDA_MPS_X"}]), True),
        (_gpu(envFrom=[{"secretRef": {"name": "c"}, "prefix": "LD_"}]), True),
        (_gpu(envFrom=[{"secretRef": {"name": "c"}, "prefix": "LD_X"}]), False),
        (_gpu(volumeMounts=[{"name": "v", "mountPath": "/tmp"}]), False),
        (_gpu(volumeMounts=[{"name": "v", "mountPath": "/usr/local"}]), False),
        (_gpu(volumeMounts=[{"name": "v", "mountPath": "/tmp/vgpulock"}]), True),
        (_gpu(volumeMounts=[{"name": "v", "mountPath": "/tmp/vgpulock/x"}]), True),
        (_gpu(volumeMounts=[{"name": "v", "mountPath": "/tmp/vgpulocks"}]), False),
        (_gpu(volumeMounts=[{"name": "v", "mountPath": "/etc/ld.so.preload"}]), True),
        (_gpu(volumeMounts=[{"name": "v", "mountPath": "/etc/ldXsoXpreload"}]), False),
        (_gpu(volumeMounts=[{"name": "v", "mountPath": "/overrideEnv"}]), True),
        (_gpu(volumeMounts=[{"name": "v", "mountPath": "/usr//local/vgpu"}]), True),
        (_gpu(volumeMounts=[{"name": "v", "mountPath": "/usr/./local/vgpu/cache"}]), True),
        (_gpu(volumeMounts=[{"name": "v", "mountPath": "/data/../usr/local/vgpu"}]), True),
        # not a GPU container: not ours to judge
        ({"name": "side", "env": ISSUE_ENV}, False),
        # a DRA claim: its env is replaced by our CDI edits; its mounts are checked
        ({"name": "c", "resources": {"claims": [{"name": "gpu"}]}, "env": ISSUE_ENV}, False),
        (
            {
                "name": "c",
                "resources": {"claims": [{"name": "gpu"}]},
                "volumeMounts": [{"name": "v", "mountPath": "/usr/local/vgpu"}],
            },
            True,
        ),
        # whole cards and MIG devices too (NVIDIA_VISIBLE_DEVICES would widen them)
        (
            {
                "name": "w",
                "resources": {"limits": {"gpushare.io/gpu": "1"}},
                "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
            },
            True,
        ),
    ],
)
def test_reserved_settings_examples(container: dict[str, Any], refused: bool) -> None:
    assert bool(_refused(RESERVED, _pod(container))) is refused


def _is_guarded(container: dict[str, Any]) -> tuple[bool, bool]:
    """(asks a gpushare resource, uses a DRA claim)"""
    resources = container.get("resources") or {}
    gpu = any(
        k in ("gpushare.io/vcuda-memory", "gpushare.io/vcuda-core", "gpushare.io/gpu")
        or k.startswith("gpushare.io/mig-")
        for k in resources.get("limits") or {}
    )
    return gpu, bool(resources.get("claims"))


_NAMES = st.sampled_from(
    [
        *reserved.RESERVED_NAMES,
        *(p + s for p in reserved.RESERVED_PREFIXES for s in ("", "0", "_1", "X")),
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_MEMORY",
        "LD_LIBRARY_PATH",
        "LD_PRELOAD_X",
        "NVIDIA_DRIVER_CAPABILITIES",
        "PATH",
    ]
)
_PREFIXES = st.one_of(
    st.none(),
    st.sampled_from(
        ["", "APP_", "CUDA", "CUDA_", "CUDA_MPS_", "CUDA_MPS_X", "L", "LD_", "N", "X_"]
    ),
    st.text(alphabet="ACDEGLMNOPRSTUV_", max_size=12),
)
_PATHS = st.one_of(
    st.sampled_from(
        [
            "/tmp",
            "/tmp/vgpulock",
            "/tmp/vgpulock/",
            "/tmp/vgpulock2",
            "/usr/local/vgpu/cache/vgpu.cache",
            "/usr/local/vgpux",
            "/etc",
            "/etc/ld.so.preload",
            "/overrideEnv",
            "/overrideEnvX",
            "/data",
            "/a//b",
            "/a/./b",
            "/a/..",
            "/a/...",
        ]
    ),
    st.lists(
        st.sampled_from(["usr", "local", "vgpu", "tmp", "etc", ".", "..", ""]), max_size=4
    ).map(lambda parts: "/" + "/".join(parts)),
)


@st.composite
def _containers(draw: st.DrawFn) -> dict[str, Any]:
    container: dict[str, Any] = {"name": draw(st.sampled_from(["a", "b", "c"]))}
    limits = draw(
        st.sets(
            st.sampled_from(
                ["gpushare.io/vcuda-memory", "gpushare.io/gpu", "gpushare.io/mig-1g.5gb", "cpu"]
            ),
            max_size=2,
        )
    )
    resources: dict[str, Any] = {}
    if limits:
        resources["limits"] = {k: "1" for k in limits}
    if draw(st.booleans()):
        resources["claims"] = [{"name": "gpu"}]
    if resources:
        container["resources"] = resources
    if draw(st.booleans()):
        container["env"] = [{"name": n, "value": "x"} for n in draw(st.lists(_NAMES, max_size=3))]
    if draw(st.booleans()):
        container["envFrom"] = [
            {"configMapRef": {"name": "m"}} | ({} if p is None else {"prefix": p})
            for p in draw(st.lists(_PREFIXES, min_size=1, max_size=2))
        ]
    if draw(st.booleans()):
        container["volumeMounts"] = [
            {"name": "v", "mountPath": p} for p in draw(st.lists(_PATHS, min_size=1, max_size=3))
        ]
    return container


@at_two_sizes(given(_containers()), quick=40, full=150, deadline=None)
def test_the_policy_and_the_daemon_agree(container: dict[str, Any]) -> None:
    gpu, claims = _is_guarded(container)
    denials = _refused(RESERVED, _pod(container))
    if gpu:
        expected = reserved.tampering(container, env=True)
    elif claims:
        expected = reserved.tampering(container, env=False)
    else:
        expected = None
    assert bool(denials) is (expected is not None), (denials, expected)
    # the rules in plain words
    if expected is None:
        return
    names = [e["name"] for e in container.get("env") or []]
    prefixes = [f.get("prefix") for f in container.get("envFrom") or []]
    paths = [m["mountPath"] for m in container.get("volumeMounts") or []]
    assert (
        (
            gpu
            and any(
                n.startswith(reserved.RESERVED_PREFIXES) or n in reserved.RESERVED_NAMES
                for n in names
            )
        )
        or (gpu and any(not p or reserved.prefix_can_form_reserved(p) for p in prefixes))
        or any(reserved.path_reserved(p) for p in paths)
    )


def test_a_prefix_is_unsafe_exactly_when_some_key_would_form_a_reserved_name() -> None:
    """Every start of a reserved name or prefix is unsafe (the rest of the name is a
    key a ConfigMap may hold); prefixes that no reserved name starts with are safe."""
    for name in (*reserved.RESERVED_NAMES, *reserved.RESERVED_PREFIXES):
        for cut in range(len(name) + 1):
            prefix = name[:cut]
            assert reserved.prefix_can_form_reserved(prefix)
            assert reserved.env_reserved(
                prefix + name[cut:] + ("X" if name in reserved.RESERVED_PREFIXES else "")
            )
    for prefix in ("APP_", "LD_X", "CUDA_X", "NVIDIA_X", "GPUX_", "X"):
        assert not reserved.prefix_can_form_reserved(prefix)


# -- the daemon's own check, where the policy is off -------------------------------------------


def _tampering_pod(node: Node, name: str, **extra: Any) -> dict[str, Any]:
    pod = node.pod(name, {node.memory: 4})
    pod["spec"]["containers"][0].update(extra)
    assert node.specs is not None
    node.specs.update(pod)
    return pod


def _failed(node: Node, pod: dict[str, Any]) -> None:
    """What the kubelet does with a pod whose admission was refused."""
    assert node.specs is not None
    node.specs.update(pod | {"status": {"phase": "Failed"}})


def test_without_the_policy_the_daemon_refuses_the_issue_pod_and_serves_the_honest_one(
    node: Node,
) -> None:
    """Before the fix the issue's pod was admitted with ``CUDA_DEVICE_MEMORY_LIMIT_0=1024m``
    in its answer and ``99999m`` after it in its spec: the runtime kept the tenant's."""
    node.with_pod_specs()
    node.start(cards(TESLA_P4, 1))
    greedy = _tampering_pod(node, "greedy", env=ISSUE_ENV)
    with pytest.raises(AdmissionError) as refused:
        node.kubelet.admit("greedy", "main", {node.memory: 4})
    message = str(refused.value)
    assert "container greedy/main sets CUDA_DEVICE_MEMORY_LIMIT_0" in message
    assert "\n" not in message
    assert not node.kubelet.admitted
    _failed(node, greedy)
    _tampering_pod(node, "honest", env=[{"name": "APP_MODE", "value": "x"}])
    record = node.kubelet.admit("honest", "main", {node.memory: 4})
    assert record.envs["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1024m"


def _sm_limit(env: dict[str, str], index: int) -> str:
    """The core limit HAMi-core keeps for ``index`` (``do_init_device_sm_limits``: the
    indexed variable, else the un-indexed one, else 100)."""
    return env.get(f"CUDA_DEVICE_SM_LIMIT_{index}") or env.get("CUDA_DEVICE_SM_LIMIT") or "100"


def test_a_grants_cdi_spec_replaces_only_the_names_it_sets(node: Node) -> None:
    """Why the env rules stay under CDI: with no pod spec to judge, a pod setting
    ``CUDA_DEVICE_SM_LIMIT_0`` ran unthrottled beside its sealed ``CUDA_DEVICE_SM_LIMIT``."""
    node.start(cards(TESLA_P4, 1), device_list_strategy="cdi-cri")
    admitted = node.kubelet.admit("tenant", "main", {node.memory: 4, node.core: 30})
    names = [d.name for r in admitted.responses.values() for d in r.cdi_devices]
    pod_env = [(e["name"], e["value"]) for e in ISSUE_ENV + UNSEALED_ENV]
    env, _mounts = final(
        [*admitted.envs.items(), *pod_env],
        [],
        [n for n in names if "/grant=" in n],
        [Path(node.settings.dra_cdi_dir)],
    )
    assert env["CUDA_DEVICE_SM_LIMIT"] == "30" and env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1024m"
    assert _sm_limit(env, 0) == "100"  # the seal alone does not hold the core limit
    assert env["GPU_CORE_UTILIZATION_POLICY"] == "disable"


@pytest.mark.parametrize("strategy", ["cdi-cri", "cdi-annotations"])
def test_under_cdi_the_daemon_refuses_what_no_spec_replaces(node: Node, strategy: str) -> None:
    """Before: under CDI the daemon checked the mounts only, so the pod above was admitted."""
    node.with_pod_specs()
    node.start(cards(TESLA_P4, 1), device_list_strategy=strategy)
    mounts = _tampering_pod(
        node,
        "mounts",
        volumeMounts=[{"name": "v", "mountPath": "/usr/local/vgpu/cache/vgpu.cache"}],
    )
    with pytest.raises(AdmissionError, match="mounts a volume at /usr/local/vgpu/cache"):
        node.kubelet.admit("mounts", "main", {node.memory: 4})
    _failed(node, mounts)
    unsealed = _tampering_pod(node, "unsealed", env=UNSEALED_ENV)
    with pytest.raises(AdmissionError, match="sets CUDA_DEVICE_SM_LIMIT_0, GPU_CORE_UTIL"):
        node.kubelet.admit("unsealed", "main", {node.memory: 4})
    assert not node.kubelet.admitted
    _failed(node, unsealed)
    _tampering_pod(node, "honest", env=[{"name": "APP_MODE", "value": "x"}])
    assert node.kubelet.admit("honest", "main", {node.memory: 4}).devices[node.memory]


@at_two_sizes(given(_containers()), quick=40, full=150, deadline=None)
def test_what_the_pod_watch_keeps_gives_the_daemon_the_same_verdict(
    container: dict[str, Any],
) -> None:
    """The daemon's pod watch keeps a slim copy of each pod (kube/podslim.py): for a GPU
    container it keeps what makes the check speak, so the verdict is the full pod's (the
    e2e run found the watch dropped env and mounts: the daemon admitted the issue's pod)."""
    container = {**container, "resources": {"limits": {"gpushare.io/vcuda-memory": "4"}}}
    pod = {
        "metadata": {"uid": "u", "namespace": "default", "name": "p"},
        "spec": {"containers": [container]},
        "status": {"phase": "Pending"},
    }
    kept = slim(pod, "gpushare.io")
    assert kept is not None
    (slimmed,) = kept["spec"]["containers"]
    for env in (True, False):
        assert bool(reserved.tampering(slimmed, env=env)) == bool(
            reserved.tampering(container, env=env)
        )
    many = {**container, "env": [{"name": "LD_PRELOAD", "value": "x" * 1000}] * 10_000}
    kept = slim({**pod, "spec": {"containers": [many]}}, "gpushare.io")
    assert kept is not None
    assert len(str(kept)) < 4_000 + 2 * len(str(container.get("volumeMounts", "")))


@pytest.mark.parametrize("strategy", ["envvar", "cdi-cri"])
def test_a_tampering_pod_cannot_deny_its_neighbour_of_the_same_shape(
    node: Node, strategy: str
) -> None:
    """Issue 41 item 10: two pods of one shape pending together, one setting reserved
    names and one setting nothing. The device-plugin API does not name the pod, and the
    daemon refused the request whenever any candidate tampered: the innocent pod was
    refused with the hostile pod's reason (4 of 4 runs on a real kubelet). Now a refusal
    from a pod spec needs every candidate to earn it: the innocent pod is admitted first,
    and the hostile one, alone left, is refused; admitted first instead (the daemon
    cannot tell), its grant's CDI spec replaces what it set."""
    node.with_pod_specs()
    node.start(cards(TESLA_P4, 2), device_list_strategy=strategy)
    _tampering_pod(node, "hostile", env=ISSUE_ENV)
    _tampering_pod(node, "innocent")
    innocent = node.kubelet.admit("innocent", "main", {node.memory: 4})
    assert innocent.devices[node.memory]
    with pytest.raises(AdmissionError, match="container hostile/main sets CUDA_DEVICE_MEMORY"):
        node.kubelet.admit("hostile", "main", {node.memory: 4})


def test_when_the_daemon_cannot_tell_the_grants_spec_holds_the_limits(node: Node) -> None:
    """The other order: the hostile pod's request comes first while both are pending; it
    is admitted (refusing would refuse whichever pod it is), and under a CDI strategy its
    final env keeps the grant's limits; the innocent pod is admitted after it."""
    node.with_pod_specs()
    node.start(cards(TESLA_P4, 2), device_list_strategy="cdi-cri")
    _tampering_pod(node, "hostile", env=ISSUE_ENV)
    _tampering_pod(node, "innocent")
    hostile = node.kubelet.admit("hostile", "main", {node.memory: 4})
    names = [d.name for r in hostile.responses.values() for d in r.cdi_devices]
    pod_env = [(e["name"], e["value"]) for e in ISSUE_ENV]
    env, _mounts = final(
        [*hostile.envs.items(), *pod_env],
        [],
        [n for n in names if "/grant=" in n],
        [Path(node.settings.dra_cdi_dir)],
    )
    assert env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1024m" and env["LD_PRELOAD"]
    assert node.kubelet.admit("innocent", "main", {node.memory: 4}).devices[node.memory]
