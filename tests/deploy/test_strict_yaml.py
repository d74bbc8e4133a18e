"""No rendered template and no manifest has a duplicate key (issue 32.17).

kubectl and PyYAML keep the last of two equal keys; a strict parser refuses the file
and a reader sees the first. The chart is rendered with every optional part on, and
every YAML file the project ships is read with :mod:`strict_yaml`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kit import strict_yaml
from test_deploy_manifests import CHART, ROOT, render_chart
from yaml.constructor import ConstructorError

#: every optional part of the chart on at least once
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "everything-on": {
        "cacheFs": {"sizeMib": 512},
        "dra": {"enabled": True, "extendedResource": {"enabled": True}},
        "scheduler": {"enabled": True, "setSchedulerName": {"enabled": True}},
        "metrics": {"service": {"enabled": True}},
        "serviceMonitor": {"enabled": True},
        "config": {"deviceListStrategy": "envvar,cdi-cri"},
    },
    "no-cache-fs": {"cacheFs": {"sizeMib": 0}, "podMonitor": {"enabled": True}},
}


def shipped_yaml() -> list[Path]:
    """Every YAML file the project ships, the chart's templates aside (Go templates)."""
    roots = [ROOT / "daemonset", ROOT / "deploy", ROOT / "src" / "gpushare" / "manifests", CHART]
    return sorted(
        path
        for root in roots
        for pattern in ("*.yaml", "*.yml")
        for path in root.rglob(pattern)
        if "templates" not in path.relative_to(root).parts
    )


def test_the_strict_loader_refuses_a_duplicate_key() -> None:
    text = "a:\n  b: 1\n  c:\n    - m: HostToContainer\n      m: Bidirectional\n"
    with pytest.raises(ConstructorError, match="duplicate key 'm'"):
        strict_yaml.load(text)
    assert strict_yaml.load("a: {b: 1, c: 2}") == {"a": {"b": 1, "c": 2}}


def test_the_strict_loader_still_merges_anchors() -> None:
    assert strict_yaml.load("x: &x {a: 1}\ny:\n  <<: *x\n  b: 2\n") == {
        "x": {"a": 1},
        "y": {"a": 1, "b": 2},
    }


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=list(VALUE_SETS))
def test_every_rendered_template_has_no_duplicate_key(values: dict[str, Any]) -> None:
    rendered = render_chart(values)
    checked = 0
    for path, text in rendered.items():
        if path.endswith((".yaml", ".yml")):
            strict_yaml.load_all(text)
            checked += 1
    assert checked >= len(list((CHART / "templates").glob("*.yaml")))


def test_the_chart_mounts_host_lib_with_one_propagation_each() -> None:
    rendered = render_chart({"cacheFs": {"sizeMib": 512}})
    (daemonset,) = [
        doc
        for path, text in rendered.items()
        if path.endswith(".yaml")
        for doc in strict_yaml.load_all(text)
        if doc and doc["kind"] == "DaemonSet"
    ]
    pod = daemonset["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (main,) = pod["containers"]
    host_lib = {
        c["name"]: m for c in (init, main) for m in c["volumeMounts"] if m["name"] == "host-lib"
    }
    # the init container's mount must reach the host; the daemon must see it
    assert host_lib["cache-fs"]["mountPropagation"] == "Bidirectional"
    assert host_lib["gpushare"]["mountPropagation"] == "HostToContainer"


@pytest.mark.parametrize("path", shipped_yaml(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_shipped_yaml_file_has_no_duplicate_key(path: Path) -> None:
    strict_yaml.load_all(path.read_text())
