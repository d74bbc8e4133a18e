"""The deployment artefacts agree with the daemon: daemonset/, the Helm chart, the image.

Paths, ports, options and the opt-in label are derived from the code (Settings
defaults, the DaemonSet's own nodeSelector), never repeated here.
The chart is rendered by Helm itself (helm-python-sdk: Helm's Go SDK in a wheel).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml
from kit import strict_yaml
from kubernetes_validate.utils import all_versions

from gpushare.config import OPTIONS, Settings, flag_name, load_settings, yaml_key
from gpushare.ops import deploy

ROOT = Path(__file__).resolve().parents[2]
DAEMONSET_DIR = ROOT / "daemonset"
CHART = ROOT / "charts" / "gpushare"
DEFAULTS = Settings()


def _minor(version: str) -> tuple[int, int]:
    major, minor, *_ = version.split(".")
    return int(major), int(minor)


def kube_versions() -> list[str]:
    """The newest minor kubernetes-validate carries and the one two minors older."""
    versions = sorted({v for v in all_versions()}, key=_minor)
    newest = versions[-1]
    major, minor = _minor(newest)
    older = next(v for v in versions if _minor(v) == (major, minor - 2))
    return [newest, older]


KUBE_VERSIONS = kube_versions()


#: Kinds GA in Kubernetes 1.36 whose v1 the schemas of kubernetes-validate (newest: 1.35)
#: do not know yet; their v1 is the promoted v1beta1, so an older schema checks them as
#: v1beta1 (the e2e suite applies them as written to a real 1.36 API server).
_V1_IN_1_36 = {"MutatingAdmissionPolicy", "MutatingAdmissionPolicyBinding"}


def validate(doc: dict[str, Any], version: str) -> None:
    """``kubernetes_validate.validate`` strictly, with :data:`_V1_IN_1_36` checked as beta."""
    if doc.get("kind") in _V1_IN_1_36 and doc.get("apiVersion") == (
        "admissionregistration.k8s.io/v1"
    ):
        doc = doc | {"apiVersion": "admissionregistration.k8s.io/v1beta1"}
    kubernetes_validate.validate(doc, version, strict=True)


def _docs(text: str) -> list[dict[str, Any]]:
    return [doc for doc in strict_yaml.load_all(text) if doc]  # issue 32.17: no duplicate keys


def manifest_files() -> list[Path]:
    """Every manifest of cluster objects under daemonset/ (the sample
    KubeSchedulerConfiguration and kustomizations are not cluster objects)."""
    return sorted(
        path
        for path in DAEMONSET_DIR.rglob("*.yaml")
        if path.name not in ("kustomization.yaml", "scheduler-config.yaml")
    )


def plain_objects() -> list[dict[str, Any]]:
    kustomization = strict_yaml.load((DAEMONSET_DIR / "kustomization.yaml").read_text())
    objects: list[dict[str, Any]] = []
    for name in kustomization["resources"]:
        objects.extend(_docs((DAEMONSET_DIR / name).read_text()))
    return objects


def render_chart(values: dict[str, Any] | None = None) -> dict[str, str]:
    with helm_python.Chart.load(CHART) as chart:
        return chart.render(values, name="gpushare", namespace="kube-system", is_install=True)


def chart_objects(values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    rendered = render_chart(values)
    return [doc for path, text in rendered.items() if path.endswith(".yaml") for doc in _docs(text)]


def chart_values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


def one(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [obj for obj in objects if obj["kind"] == kind]
    return found


# -- schemas ---------------------------------------------------------------------------


def test_two_kubernetes_versions_are_checked() -> None:
    newest, older = KUBE_VERSIONS
    assert _minor(newest)[1] - _minor(older)[1] == 2
    assert _minor(newest) >= (1, 32)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_manifest_validates(path: Path, version: str) -> None:
    docs = _docs(path.read_text())
    assert docs
    for doc in docs:
        validate(doc, version)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_chart_template_renders_and_validates(version: str) -> None:
    rendered = render_chart()
    templates = {Path(path).name for path in rendered if path.endswith(".yaml")}
    assert templates == {p.name for p in (CHART / "templates").glob("*.yaml")}
    objects = chart_objects()
    assert {obj["kind"] for obj in objects} == {
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",  # the node's state object (ConfigMap gpushare-node-<node>)
        "RoleBinding",
        "ConfigMap",
        "DaemonSet",
        "NetworkPolicy",  # networkPolicy.* (tests/doors/metrics/test_listener_bounds.py)
        "ValidatingAdmissionPolicy",  # policies.* (tests/deploy/test_policies.py)
        "ValidatingAdmissionPolicyBinding",
    }
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_chart_lints_without_errors() -> None:
    report = helm_python.lint(CHART, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


# -- the DaemonSet runs where it should, with what the daemon uses ----------------------


#: The host's cgroup v2 tree (the driver self-test's scratch cgroup is made there).
HOST_CGROUP = "/sys/fs/cgroup"


def _daemon_paths() -> dict[str, str]:
    """Host paths the daemon uses with its defaults (each mounted at the same path);
    the defaults (memoryEnforcement auto) include the driver self-test's cgroup tree."""
    return {
        "kubelet_dir": DEFAULTS.kubelet_dir,
        "pod_resources": os.path.dirname(DEFAULTS.pod_resources_socket),
        "host_lib_dir": DEFAULTS.host_lib_dir,
        "cgroup_root": DEFAULTS.cgroup_root,
    }


def _pod_spec(daemonset: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = daemonset["spec"]["template"]["spec"]
    return spec


def _container(daemonset: dict[str, Any]) -> dict[str, Any]:
    (container,) = _pod_spec(daemonset)["containers"]
    return dict(container)


def _host_mounts(daemonset: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """hostPath -> (mountPath, readOnly) of the daemon container."""
    volumes = {v["name"]: v for v in _pod_spec(daemonset)["volumes"]}
    mounts = {}
    for mount in _container(daemonset)["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "hostPath" in volume:
            mounts[volume["hostPath"]["path"]] = (mount["mountPath"], mount.get("readOnly", False))
    return mounts


def _settings_of(container: dict[str, Any]) -> Settings:
    """The Settings the container's command line and env give the daemon."""
    env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    args = list(container.get("args", []))
    return load_settings(args, env)


def daemonsets() -> Iterator[tuple[str, dict[str, Any]]]:
    yield "daemonset/", one(plain_objects(), "DaemonSet")
    yield "chart", one(chart_objects(), "DaemonSet")


@pytest.mark.parametrize("source", ["daemonset/", "chart"])
def test_daemonset_runs_only_on_opted_in_gpu_nodes(source: str) -> None:
    daemonset = dict(daemonsets())[source]
    spec = _pod_spec(daemonset)
    key, value = deploy.opt_in_label(deploy.load_objects())
    assert spec["nodeSelector"] == {key: value}
    assert chart_values()["optInLabel"] == {"key": key, "value": value}
    assert "affinity" not in spec
    assert daemonset["metadata"]["namespace"] == "kube-system"
    tolerations = {(t["key"], t["operator"], t.get("effect")) for t in spec["tolerations"]}
    assert tolerations == {
        ("nvidia.com/gpu", "Exists", "NoSchedule"),
        ("CriticalAddonsOnly", "Exists", None),
    }
    assert spec["priorityClassName"] == "system-node-critical"
    assert daemonset["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1},
    }


@pytest.mark.parametrize("source", ["daemonset/", "chart"])
def test_daemonset_mounts_exactly_the_paths_of_the_daemon_defaults(source: str) -> None:
    daemonset = dict(daemonsets())[source]
    mounts = _host_mounts(daemonset)
    expected = set(_daemon_paths().values())
    assert set(mounts) == expected
    for host_path, (mount_path, _) in mounts.items():
        assert mount_path == host_path  # the daemon hands host paths to the kubelet
    assert mounts[_daemon_paths()["pod_resources"]][1] is True  # only read
    assert mounts[DEFAULTS.kubelet_dir][1] is False  # its sockets are created there
    assert mounts[DEFAULTS.host_lib_dir][1] is False
    # the scratch cgroup is made (mkdir), limited and removed there: the HOST's tree, writable
    assert DEFAULTS.cgroup_root == HOST_CGROUP and mounts[HOST_CGROUP][1] is False


def test_plain_daemonset_runs_the_daemon_with_its_default_paths_and_json_logs() -> None:
    container = _container(one(plain_objects(), "DaemonSet"))
    assert container["command"] == ["gpushare-device-plugin"]
    settings = _settings_of(container)
    assert settings.log_format == "json"
    for name in ("kubelet_dir", "pod_resources_socket", "host_lib_dir", "library", "metrics_port"):
        assert getattr(settings, name) == getattr(DEFAULTS, name), name


@pytest.mark.parametrize("source", ["daemonset/", "chart"])
def test_daemonset_env_probe_and_resources(source: str) -> None:
    container = _container(dict(daemonsets())[source])
    env = {e["name"]: e for e in container["env"]}
    node_name = next(o for o in OPTIONS if o.name == "node_name")
    assert env[node_name.metadata["env"]]["valueFrom"] == {
        "fieldRef": {"fieldPath": "spec.nodeName"}
    }
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    (port,) = container["ports"]
    assert port["containerPort"] == DEFAULTS.metrics_port
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    assert probe["port"] == port["name"]
    probe = container["readinessProbe"]["httpGet"]
    assert probe["path"] == "/readyz"
    assert probe["port"] == port["name"]
    resources = container["resources"]
    assert set(resources["requests"]) == {"cpu", "memory"}
    assert "memory" in resources["limits"]
    assert "cpu" not in resources["limits"]


@pytest.mark.parametrize("source", ["daemonset/", "chart"])
def test_daemonset_runs_with_the_least_privileges(source: str) -> None:
    daemonset = dict(daemonsets())[source]
    spec = _pod_spec(daemonset)
    context = _container(daemonset)["securityContext"]
    # what deleting tenants' leftovers needs (docs/security.md, daemon/test_tenant_dirs.py),
    # and, with memoryEnforcement auto (the default), NVML's set in the driver self-test
    assert context["capabilities"] == {
        "drop": ["ALL"],
        "add": ["DAC_OVERRIDE", "FOWNER", "SYS_ADMIN"],
    }
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True
    assert context.get("privileged", False) is False
    assert context["runAsUser"] == 0  # the kubelet's sockets are root-owned
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for forbidden in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(forbidden, False), forbidden
    assert spec["serviceAccountName"] == daemonset["metadata"]["name"]


@pytest.mark.parametrize(
    ("pins", "driver"),
    [
        ("auto", True),
        ("driver", True),
        ("interposer,0=driver", True),
        ("interposer", False),
        ("hardware", False),
        ("interposer,1=hardware", False),
    ],
)
def test_the_chart_gives_the_driver_self_test_its_cgroup_tree_and_sys_admin_only_when_it_can_run(
    pins: str, driver: bool
) -> None:
    """SYS_ADMIN and the host's cgroup tree exactly where memoryEnforcement may give
    ``driver`` (the self-test runs only then: node/backendfacts.py); elsewhere neither."""
    values = chart_values()
    values["config"]["memoryEnforcement"] = pins
    values["config"]["cgroupRoot"] = "/host/cgroup"
    daemonset = one(chart_objects(values), "DaemonSet")
    context = _container(daemonset)["securityContext"]
    added = ["DAC_OVERRIDE", "FOWNER"] + (["SYS_ADMIN"] if driver else [])
    assert context["capabilities"] == {"drop": ["ALL"], "add": added}
    assert context.get("privileged", False) is False
    assert context["allowPrivilegeEscalation"] is False
    mounts = _host_mounts(daemonset)
    assert (mounts.get(HOST_CGROUP) == ("/host/cgroup", False)) is driver
    assert (HOST_CGROUP in mounts) is driver
    settings = load_settings([], {})
    assert settings.memory_enforcement == "auto"  # the daemon's default is one that needs them


def test_the_memory_hook_is_installed_on_the_host_beside_the_interposer() -> None:
    """The image carries the hook at the daemon's default path; the daemon copies it into
    --host-lib-dir (a writable hostPath, same path on the host) beside libvgpu.so, outside
    the noexec cache file system, where the runtime runs it on the host."""
    from gpushare.host.library import cache_root, install_hook, install_library

    final = _stages()[-1][1]
    assert any(
        line.startswith("COPY --from=memory-hook ") and line.endswith(f" {DEFAULTS.memory_hook}")
        for line in final
    )
    assert chart_values()["config"]["memoryHook"] == DEFAULTS.memory_hook
    for _source, daemonset in daemonsets():
        mounts = _host_mounts(daemonset)
        assert mounts[DEFAULTS.host_lib_dir] == (DEFAULTS.host_lib_dir, False)
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "hook"
        source.write_bytes(b"#!/bin/sh\n")
        library = Path(scratch) / "lib"
        library.write_bytes(b"\x7fELF")
        host = Path(scratch) / "host"
        hook = install_hook(source, host)
        assert hook.parent == install_library(library, host).parent == host
        assert os.access(hook, os.X_OK)
        assert cache_root(host) not in hook.parents  # the noexec tmpfs is containers/ only


# -- RBAC: the verbs of the calls the daemon makes, and nothing more --------------------

def _verb(method: str, path: str, query: dict[str, list[str]]) -> tuple[str, str]:
    """(resource, RBAC verb) of one HTTP request to the API server."""
    parts = path.strip("/").split("/")  # api v1 [namespaces ns] resource [name]
    rest = parts[2:]
    if len(rest) >= 3 and rest[0] == "namespaces":
        rest = rest[2:]
    if method == "GET" and len(rest) == 1:
        return rest[0], "watch" if query.get("watch") else "list"
    return rest[0], {"GET": "get", "PATCH": "patch", "POST": "create", "DELETE": "delete"}[method]


@pytest.fixture(scope="module")
def daemon_api_verbs() -> set[tuple[str, str]]:
    """What the daemon asks of the API server, recorded at the double's HTTP boundary
    while it publishes its Node, watches its pods and annotates an admitted one, and
    while a daemon switched to ``--node-state annotation`` retires the state object."""
    from conftest import TESLA_P4, Node, cards
    from kit.kube_double import KubeApiDouble
    from kit.procs import poll

    double = KubeApiDouble()
    double.start()
    root = Path(tempfile.mkdtemp(prefix="gs-", dir="/tmp"))
    node = Node(root)
    saved = {k: os.environ.get(k) for k in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    try:
        os.environ["KUBECONFIG"] = str(double.kubeconfig(root / "kubeconfig"))
        os.environ.pop("KUBERNETES_SERVICE_HOST", None)
        double.add({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n"}})
        pod = node.pod("a", {node.memory: 2}) | {"apiVersion": "v1", "kind": "Pod"}
        pod["spec"]["nodeName"] = "n"
        double.add(pod)
        daemon = node.start(cards(TESLA_P4, 1), node_name="n")
        node.kubelet.admit("a", "main", {node.memory: 2})
        assert daemon.core.api_link is not None
        assert poll(lambda: bool(double.calls("PATCH", "/pods/a")), 30.0)
        assert poll(lambda: bool(double.calls("GET", "/api/v1/pods")), 30.0)
        assert poll(lambda: any("watch" in r.query for r in double.requests), 30.0)
        # the state object: created, then patched with the admitted pod's use
        assert poll(lambda: bool(double.calls("PATCH", "/configmaps/gpushare-node-n")), 30.0)
        node.stop()
        node.start(cards(TESLA_P4, 1), node_name="n", node_state="annotation")
        assert poll(lambda: bool(double.calls("DELETE", "/configmaps/gpushare-node-n")), 30.0)
    finally:
        node.stop()
        double.stop()
        shutil.rmtree(root, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {_verb(r.method, r.path, r.query) for r in double.requests}


@pytest.mark.parametrize("source", ["daemonset/", "chart"])
def test_cluster_role_grants_exactly_what_the_daemon_calls(
    source: str, daemon_api_verbs: set[tuple[str, str]]
) -> None:
    objects = plain_objects() if source == "daemonset/" else chart_objects()
    needed = daemon_api_verbs - {
        ("configmaps", v) for v in ("get", "create", "patch", "delete")
    }
    assert daemon_api_verbs - needed == {
        ("configmaps", "get"),
        ("configmaps", "create"),
        ("configmaps", "patch"),
        ("configmaps", "delete"),
    }
    assert needed == {
        ("nodes", "get"),
        ("nodes", "patch"),
        ("pods", "list"),
        ("pods", "watch"),
        ("pods", "patch"),
    }
    # the state object's verbs are a Role's, in the daemon's own namespace only
    role = one(objects, "Role")
    assert {
        (resource, verb)
        for rule in role["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        if rule["apiGroups"] == [""]
    } == daemon_api_verbs - needed
    role_binding = one(objects, "RoleBinding")
    assert role_binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    granted = {
        (resource, verb)
        for rule in one(objects, "ClusterRole")["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        if rule["apiGroups"] == [""]
    }
    assert granted == needed
    assert all(rule["apiGroups"] == [""] for rule in one(objects, "ClusterRole")["rules"])
    binding = one(objects, "ClusterRoleBinding")
    account = one(objects, "ServiceAccount")
    assert binding["roleRef"]["name"] == one(objects, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {
            "kind": "ServiceAccount",
            "name": account["metadata"]["name"],
            "namespace": account["metadata"]["namespace"],
        }
    ]
    assert role_binding["subjects"] == binding["subjects"]
    namespace = account["metadata"]["namespace"]
    assert role["metadata"]["namespace"] == role_binding["metadata"]["namespace"] == namespace
    # ... which is where the daemon writes: POD_NAMESPACE, from the downward API
    env_list = _container(one(objects, "DaemonSet"))["env"]
    (env,) = [e for e in env_list if e["name"] == "POD_NAMESPACE"]
    assert env["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


# -- the chart's values are the daemon's options ----------------------------------------


def test_chart_config_values_are_the_daemon_options_with_the_same_defaults() -> None:
    config = chart_values()["config"]
    assert set(config) == {yaml_key(option.name) for option in OPTIONS}
    for option in OPTIONS:
        value = config[yaml_key(option.name)]
        assert type(value) is type(option.default), option.name
        assert value == option.default, option.name


def test_chart_config_file_gives_the_daemon_its_defaults(tmp_path: Path) -> None:
    objects = chart_objects()
    config_file = tmp_path / "config.yaml"
    config_file.write_text(one(objects, "ConfigMap")["data"]["config.yaml"])
    container = _container(one(objects, "DaemonSet"))
    (arg,) = container["args"]
    assert arg.startswith("--config=")
    assert one(objects, "ConfigMap")["metadata"]["name"] in {
        v.get("configMap", {}).get("name") for v in _pod_spec(one(objects, "DaemonSet"))["volumes"]
    }
    settings = load_settings([f"--config={config_file}"], {})
    assert settings == DEFAULTS


def test_chart_values_move_the_mounts_with_the_paths() -> None:
    config = dict(chart_values()["config"])
    config.update(kubeletDir="/srv/kubelet/dp", podResourcesSocket="/srv/kubelet/pr/k.sock")
    config.update(hostLibDir="/opt/vgpu", metricsPort=9500)
    daemonset = one(chart_objects({"config": config}), "DaemonSet")
    assert set(_host_mounts(daemonset)) == {
        "/srv/kubelet/dp",
        "/srv/kubelet/pr",
        "/opt/vgpu",
        HOST_CGROUP,
    }
    assert _container(daemonset)["ports"][0]["containerPort"] == 9500
    labelled = one(
        chart_objects({"optInLabel": {"key": "example.com/gpu", "value": "yes"}}), "DaemonSet"
    )
    assert _pod_spec(labelled)["nodeSelector"] == {"example.com/gpu": "yes"}


# -- package copy, example workload ---------------------------------------------------


def test_packaged_manifests_are_the_daemonset_directory() -> None:
    shipped = deploy.manifest_texts()
    on_disk = {path.name: path.read_text() for path in DAEMONSET_DIR.glob("*.yaml")}
    on_disk |= {
        f"policies/{path.name}": path.read_text()
        for path in (DAEMONSET_DIR / "policies").glob("*.yaml")
    }
    assert shipped == on_disk, "run `make manifests` after editing daemonset/"


def test_example_workload_asks_for_4_memory_and_100_core_units() -> None:
    (pod,) = _docs((DAEMONSET_DIR / "examples" / "workload.yaml").read_text())
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["limits"] == {
        DEFAULTS.memory_resource: 4,
        DEFAULTS.core_resource: 100,
    }


# -- the image --------------------------------------------------------------------------


def _dockerfile() -> list[str]:
    """Instructions of the Dockerfile, continuation lines joined, comments dropped."""
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def _stages() -> list[tuple[str, list[str]]]:
    """(FROM line, instructions) per stage."""
    stages: list[tuple[str, list[str]]] = []
    for line in _dockerfile():
        if line.upper().startswith("FROM "):
            stages.append((line, []))
        elif stages:
            stages[-1][1].append(line)
    return stages


def _global_args() -> dict[str, str]:
    args = {}
    for line in _dockerfile():
        if line.upper().startswith("FROM "):
            break
        match = re.fullmatch(r"ARG (\w+)=(\S+)", line)
        if match:
            args[match[1]] = match[2]
    return args


def _pinned(image: str) -> bool:
    if "@sha256:" in image:
        return True
    name, _, tag = image.rpartition(":")
    return (
        bool(name)
        and "/" not in tag
        and tag not in ("", "latest")
        and any(c.isdigit() for c in tag)
    )


def test_image_is_multi_stage_with_pinned_bases() -> None:
    args = _global_args()
    stages = _stages()
    assert len(stages) >= 3
    names = set()
    for from_line, _ in stages:
        words = from_line.split()
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], words[1])
        assert image in names or _pinned(image), from_line
        if len(words) == 4 and words[2].upper() == "AS":
            names.add(words[3])


def test_image_builds_as_non_root_and_final_stage_has_no_compiler() -> None:
    stages = _stages()
    build = [body for line, body in stages if line.split()[-1] == "build"]
    assert build, "no stage named build"
    users = [line.split()[1] for line in build[0] if line.upper().startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    final = " ".join(stages[-1][1])
    for compiler in ("gcc", "g++", "build-essential", "clang", "make"):
        assert compiler not in final.split(), compiler
    assert "apt-get install" not in final


def test_image_carries_hami_interposer_at_the_daemon_default_library_path() -> None:
    args = _global_args()
    assert re.fullmatch(r"v\d+\.\d+\.\d+", args["HAMI_VERSION"])
    stages = _stages()
    (hami,) = [line for line, _ in stages if "projecthami/hami" in line]
    assert "${HAMI_VERSION}" in hami
    hami_stage = hami.split()[-1]
    lines = [line for _, body in stages for line in body]
    assert any(
        line.startswith(f"COPY --from={hami_stage} ") and "/k8s-vgpu/lib/nvidia/" in line
        for line in lines
    )
    assert any("libvgpu.so.*" in line for line in lines)  # versioned names are handled
    final = stages[-1][1]
    assert any(
        line.startswith("COPY --from=") and line.endswith(f" {DEFAULTS.library}") for line in final
    )


def test_image_default_command_runs_the_daemon_with_json_logs() -> None:
    (cmd,) = [line for line in _stages()[-1][1] if line.startswith("CMD ")]
    command = yaml.safe_load(cmd[4:])
    assert command[0] == "gpushare-device-plugin"
    assert flag_name("log_format") in " ".join(command)
    assert load_settings(command[1:], {}).log_format == "json"


def test_dockerignore_keeps_the_context_small() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert "*" in lines  # everything is out unless named
    kept = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    scripts = {"scripts/check-interposer.sh", "scripts/build-hami-core.sh"}  # the interposer
    programs = {"hook/memory-hook.c", "hook/libvgpu-stub.c"}  # the C the image compiles
    assert kept == {"pyproject.toml", "setup.py", "README.md", "proto", "src", *scripts, *programs}
    # every file a COPY takes from the context is kept
    for line in _dockerfile():
        if line.startswith("COPY ") and "--from=" not in line:
            for source in line.split()[1:-1]:
                if not source.startswith("--"):
                    assert any(source == k or source.startswith(k + "/") for k in kept), source


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "localhost"])
def test_the_chart_refuses_a_loopback_metrics_address_the_probes_cannot_reach(
    address: str,
) -> None:
    with pytest.raises(helm_python.HelmRenderError, match=r"config\.metricsAddress is a loopback"):
        render_chart({"config": {"metricsAddress": address}})
    # Without the endpoint there are no probes, and nothing to refuse.
    assert chart_objects({"config": {"metricsAddress": address, "metricsPort": 0}})


@pytest.mark.parametrize("strategy", ["none", "single", "mixed"])
def test_chart_never_asks_for_the_mig_monitor_capability(strategy: str) -> None:
    """NVIDIA's runtime hook refuses NVIDIA_MIG_MONITOR_DEVICES without CAP_SYS_ADMIN,
    which the daemon has only where the driver self-test may run (memoryEnforcement
    auto or driver): pinned to interposer it has not, and the pod would not start on a
    MIG node. The chart never asks for it, whatever the memory backends."""
    for memory in ("auto", "interposer"):
        values = chart_values()
        values["config"]["migStrategy"] = strategy
        values["config"]["memoryEnforcement"] = memory
        daemonset = one(chart_objects(values), "DaemonSet")
        env = {e["name"]: e.get("value") for e in _container(daemonset)["env"]}
        assert "NVIDIA_MIG_MONITOR_DEVICES" not in env
        added = _container(daemonset)["securityContext"]["capabilities"].get("add", [])
        assert ("SYS_ADMIN" in added) is (memory == "auto")


def test_the_chart_puts_the_daemon_on_the_host_network_only_when_asked() -> None:
    """``hostNetwork`` (docs/deploy.md, "Helm"; the e2e's chart install on a cluster
    without a pod network uses it): the pod in the node's network namespace, with the DNS
    policy that keeps cluster names resolvable there; off by default (the least privileges
    test above checks the default)."""
    spec = _pod_spec(one(chart_objects({"hostNetwork": True}), "DaemonSet"))
    assert spec["hostNetwork"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    default = _pod_spec(one(chart_objects(), "DaemonSet"))
    assert "hostNetwork" not in default and "dnsPolicy" not in default
