"""A daemon stopped on a node that lost its opt-in label (``kubectl gpushare uninstall``)
removes from the host directory what no container the kubelet lists can use, and keeps
what a running container holds (docs/deploy.md, "Uninstall"); a daemon stopped on a node
that keeps the label (a restart, a rolling update) removes nothing."""

from __future__ import annotations

from pathlib import Path

from conftest import NODE, TESLA_P4, Node, cards
from kit.kube_double import KubeApiDouble
from kit.procs import eventually

LABEL = "gpushare.io/enabled=true"


def _label(api: KubeApiDouble, value: str | None) -> None:
    node = api.get("Node", NODE)
    labels = node["metadata"].setdefault("labels", {})
    labels.pop("gpushare.io/enabled", None)
    if value is not None:
        labels["gpushare.io/enabled"] = value
    api.add(node)


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def _start_with_two_containers(node: Node, api: KubeApiDouble) -> None:
    _label(api, "true")
    node.start(cards(TESLA_P4, 1), node_name=NODE, opt_in_label=LABEL)
    eventually(lambda: node.daemon is not None and node.daemon.core.api_link.publishes, 30)
    for name in ("kept", "gone"):
        node.kubelet.admit(name, "main", {node.memory: 2, node.core: 10})
    node.kubelet.release("gone")


def test_an_uninstall_keeps_only_what_the_running_container_holds(
    node: Node, api: KubeApiDouble
) -> None:
    _start_with_two_containers(node, api)
    host = Path(node.settings.host_lib_dir)
    before = _files(host)
    caches = {n for n in before if n.startswith("containers/c-") and not n.endswith(".json")}
    assert len(caches) == 2, before
    library = {n for n in before if n.startswith("libvgpu.so.")}
    assert library and "memory-unit.json" in before
    _label(api, None)
    node.stop()
    after = _files(host)
    (kept,) = caches & after  # the running container's cache
    assert after == {
        kept,
        f"{kept}.json",
        "containers",
        "containers/vgpulock",
        "memory-unit.json",
        *library,
        *{n for n in before if n.startswith(("ld.so.preload.", "gpushare-memory-hook."))},
    }


def test_with_no_container_left_the_host_dir_is_emptied(node: Node, api: KubeApiDouble) -> None:
    _start_with_two_containers(node, api)
    node.kubelet.release("kept")
    host = Path(node.settings.host_lib_dir)
    assert _files(host)
    _label(api, None)
    node.stop()
    assert _files(host) == set()


def test_a_stop_on_a_node_that_keeps_its_label_removes_nothing(
    node: Node, api: KubeApiDouble
) -> None:
    _start_with_two_containers(node, api)
    node.kubelet.release("kept")
    host = Path(node.settings.host_lib_dir)
    before = _files(host)
    node.stop()
    assert _files(host) == before


def test_without_an_opt_in_label_set_an_unlabelled_node_keeps_everything(
    node: Node, api: KubeApiDouble
) -> None:
    node.start(cards(TESLA_P4, 1), node_name=NODE)
    eventually(lambda: node.daemon is not None and node.daemon.core.api_link.publishes, 30)
    node.kubelet.admit("a", "main", {node.memory: 2, node.core: 10})
    node.kubelet.release("a")
    host = Path(node.settings.host_lib_dir)
    before = _files(host)
    node.stop()
    assert _files(host) == before


def test_what_a_tenant_built_in_its_cache_is_removed_through_no_link(
    node: Node, api: KubeApiDouble, short_tmp: Path
) -> None:
    _start_with_two_containers(node, api)
    node.kubelet.release("kept")
    host = Path(node.settings.host_lib_dir)
    outside = short_tmp / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    (cache,) = [p for p in (host / "containers").glob("c-*") if p.is_dir()][:1]
    (cache / "link").symlink_to(outside)
    deep = cache
    for _ in range(200):  # deeper than a recursive delete would like
        deep = deep / "d"
    deep.mkdir(parents=True)
    (deep / "f").write_text("x")
    locked = cache / "locked"
    locked.mkdir()
    (locked / "inside").write_text("x")
    locked.chmod(0)
    _label(api, None)
    node.stop()
    assert _files(host) == set()
    assert (outside / "precious").read_text() == "keep me"
