"""Scenario 5: every manifest of daemonset/ and deploy/, the Helm chart rendered with its
defaults and its documented options, accepted by the real API server (server-side apply,
dry run: the server's defaulting, validation and admission, nothing stored)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from kube_cluster import MEMORY, REPO, Cluster, wait_for

CHART = REPO / "charts" / "gpushare"
#: Files that are not cluster objects.
NOT_OBJECTS = {"kustomization.yaml", "scheduler-config.yaml"}
#: API groups this cluster does not serve: prometheus-operator's CRDs, and krew's plugin
#: manifest (deploy/krew/, read by `kubectl krew`, never sent to a cluster).
FOREIGN_GROUPS = {"monitoring.coreos.com", "krew.googlecontainertools.github.com"}


def manifest_files() -> list[Path]:
    files = sorted(REPO.glob("daemonset/**/*.yaml")) + sorted(REPO.glob("deploy/**/*.yaml"))
    return [f for f in files if f.name not in NOT_OBJECTS]


def objects_of(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if isinstance(d, dict) and d.get("kind")]


def refused(cluster: Cluster, objects: list[dict[str, Any]]) -> list[str]:
    out = []
    for obj in objects:
        if obj["apiVersion"].split("/")[0] in FOREIGN_GROUPS:
            continue
        reply = cluster.api.apply(obj, dry_run=True)
        if reply.status_code >= 300:
            out.append(
                f"{obj['kind']}/{obj['metadata'].get('name')}: {reply.status_code} "
                f"{reply.json().get('message', reply.text)[:400]}"
            )
    return out


@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_the_manifest_is_accepted(cluster: Cluster, path: Path) -> None:
    objects = objects_of(path.read_text())
    if not [o for o in objects if o["apiVersion"].split("/")[0] not in FOREIGN_GROUPS]:
        pytest.skip("no object of an API group a cluster serves in this file")
    assert refused(cluster, objects) == []


def doc_examples() -> list[tuple[str, dict[str, Any]]]:
    """Every whole Kubernetes object in a ```yaml block of README.md and docs/*.md."""
    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        for block in re.findall(r"```ya?ml\n(.*?)```", path.read_text(), re.S):
            try:
                docs = list(yaml.safe_load_all(block))
            except yaml.YAMLError:
                continue  # a fragment, not a manifest
            for doc in docs:
                if isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"):
                    where = f"{path.relative_to(REPO)}:{doc['kind']}/{doc['metadata']['name']}"
                    found.append((where, doc))
    return found


@pytest.mark.parametrize("where,obj", doc_examples(), ids=[w for w, _ in doc_examples()])
def test_the_docs_example_is_accepted(cluster: Cluster, where: str, obj: dict[str, Any]) -> None:
    assert refused(cluster, [obj]) == [], where


CHART_VALUES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "no-policies": {
        "policies": {"coreNeedsMemory": {"enabled": False}, "daemonNodeScope": {"enabled": False}}
    },
    "metrics-service": {"metrics": {"service": {"enabled": True}}},
    "scheduler": {"scheduler": {"enabled": True}},
    "scheduler-set-name-v1": {
        "scheduler": {
            "enabled": True,
            "setSchedulerName": {"enabled": True, "apiVersion": "admissionregistration.k8s.io/v1"},
        }
    },
    "whole-cards-cdi-mig": {
        "config": {
            "wholeCards": True,
            "deviceListStrategy": "envvar,cdi-cri",
            "migStrategy": "mixed",
        }
    },
    "opt-in-label": {"optInLabel": {"key": "example.com/gpu", "value": "yes"}},
    "many-options": {
        "runtimeClassName": "nvidia",
        "imagePullSecrets": [{"name": "regcred"}],
        "extraEnv": [{"name": "GPUSHARE_LOG_LEVEL", "value": "debug"}],
        "extraArgs": ["--log-level=debug"],
        "podAnnotations": {"example.com/a": "b"},
        "podLabels": {"example.com/c": "d"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "updateStrategy": {"type": "OnDelete"},
        "fullnameOverride": "gpu-share",
        "priorityClassName": "",
        "metrics": {"service": {"enabled": True}},
        "serviceMonitor": {"enabled": True},
        "podMonitor": {"enabled": True},
        "config": {
            "placement": "spread",
            "memoryUnitMib": 512,
            "resourcePrefix": "example.com",
            "cardModes": "0=shared",
            "exclusiveEnforcement": True,
            "wholeCards": True,
        },
    },
}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm_python.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="gpushare", namespace="kube-system", is_install=True)
    return [
        o for path, text in rendered.items() if path.endswith(".yaml") for o in objects_of(text)
    ]


@pytest.mark.parametrize("name", sorted(CHART_VALUES))
def test_the_rendered_chart_is_accepted(cluster: Cluster, name: str) -> None:
    objects = render(CHART_VALUES[name])
    assert objects
    assert refused(cluster, objects) == []


def test_the_mutating_policy_sets_the_scheduler_name(cluster: Cluster) -> None:
    """daemonset/scheduler/set-scheduler-name.yaml as written (v1, GA in 1.36) is accepted,
    and it works: a pod asking shared units gets schedulerName gpushare-scheduler from the
    real API server."""
    objects = objects_of((REPO / "daemonset/scheduler/set-scheduler-name.yaml").read_text())
    assert {obj["apiVersion"] for obj in objects} == {"admissionregistration.k8s.io/v1"}
    try:
        for obj in objects:
            reply = cluster.api.apply(obj)
            assert reply.status_code < 300, reply.text
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "mutated", "namespace": "default"},
            "spec": {
                "containers": [
                    {
                        "name": "main",
                        "image": "registry.k8s.io/pause:3.10",
                        "resources": {"limits": {MEMORY: "4"}},
                    }
                ]
            },
        }

        assert wait_for("the policy to set schedulerName", lambda: scheduler_name(cluster, pod), 60)
    finally:
        for obj in reversed(objects):
            cluster.api.delete(cluster.api.path(obj))
        # Later tests' pods must not be sent to a scheduler that is not running.
        wait_for("the policy to be gone", lambda: not scheduler_name(cluster, pod), 60)


def scheduler_name(cluster: Cluster, pod: dict[str, Any]) -> bool:
    """Whether the API server gives this pod schedulerName gpushare-scheduler (dry run)."""
    reply = cluster.api.create(pod, dry_run=True)
    assert reply.status_code == 201, reply.text
    return bool(reply.json()["spec"].get("schedulerName") == "gpushare-scheduler")
