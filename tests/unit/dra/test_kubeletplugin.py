"""gpushare.dra.kubeletplugin: the DRA server listens where the kubelet's plugin watcher and
the kubelet look (the registration socket in ``plugins_registry``, the service under
``plugins/<driver>``), advertises the versions it serves, records what the kubelet says
of the registration and tells its listeners, every time the kubelet registers it."""

from __future__ import annotations

from pathlib import Path

from test_dra_plugin import DRIVER, DraNode, dra

from gpushare.dra.kubeletplugin import (
    PLUGIN_TYPE,
    SUPPORTED_SERVICES,
    DraServer,
    registration_socket,
    service_socket,
)
from gpushare.sim.drakubeletdouble import DraKubelet

__all__ = ["dra"]  # fixture (test_dra_plugin's DRA node, stopped after the test)


def test_the_sockets_are_where_the_kubelet_looks() -> None:
    root = Path("/var/lib/kubelet")
    assert registration_socket(root, DRIVER) == root / "plugins_registry" / f"{DRIVER}-reg.sock"
    assert service_socket(root, DRIVER) == root / "plugins" / DRIVER / "dra.sock"


def test_each_registration_is_recorded_and_announced(dra: DraNode) -> None:
    part = dra.build()
    server: DraServer = part.server
    dra.part = part
    heard: list[bool] = []
    server.on_registered.append(lambda: heard.append(True))
    assert server.registered is None  # the kubelet has not said yet
    part.start()
    assert server.registration_path.is_socket() and server.service_path.is_socket()
    assert server.registration_path == registration_socket(dra.kubelet_root, DRIVER)
    assert dra.kubelet.register() == SUPPORTED_SERVICES[0]
    assert dra.kubelet.info.type == PLUGIN_TYPE
    assert list(dra.kubelet.info.supported_versions) == list(SUPPORTED_SERVICES)
    assert server.registered is True and server.registration_error == "" and heard == [True]
    again = DraKubelet(dra.kubelet_root)  # a restarted kubelet registers it again
    try:
        again.register()
    finally:
        again.close()
    assert heard == [True, True]
