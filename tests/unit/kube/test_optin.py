"""``kube/optin.py``: a stop is an uninstall only when the Node, read, lacks the label."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kit.kube_double import KubeApiDouble

from gpushare.kube.optin import node_opted_out
from gpushare.kube.stdlibclient import ApiClient, load_endpoint

LABEL = "gpushare.io/enabled=true"


@pytest.fixture
def api(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[KubeApiDouble, ApiClient]]:
    double = KubeApiDouble()
    double.start()
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(double.kubeconfig(tmp_path / "kubeconfig")))
    client = ApiClient(load_endpoint())
    try:
        yield double, client
    finally:
        client.close()
        double.stop()


@pytest.mark.parametrize(
    ("labels", "opted_out"),
    [
        ({"gpushare.io/enabled": "true"}, False),
        ({}, True),
        ({"gpushare.io/enabled": "false"}, True),
        ({"other": "true"}, True),
    ],
)
def test_the_label_read_decides(
    api: tuple[KubeApiDouble, ApiClient], labels: dict[str, str], opted_out: bool
) -> None:
    double, client = api
    double.add({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "labels": labels}})
    assert node_opted_out(client, "n1", LABEL) is opted_out


def test_what_cannot_be_known_is_not_an_uninstall(api: tuple[KubeApiDouble, ApiClient]) -> None:
    double, client = api
    double.add({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "n1", "labels": {}}})
    assert node_opted_out(client, "n1", "") is False  # no label configured
    assert node_opted_out(client, "n1", "gpushare.io/enabled") is False  # no value given
    assert node_opted_out(client, "gone", LABEL) is False  # the Node is not there
    double.fail_next(3, 500)
    assert node_opted_out(client, "n1", LABEL) is False  # the API server answers an error
