"""A claim whose preparation fails half-way leaves nothing on the host: the cache
directory made for it is released again (``ClaimPreparer._apply`` undoes what it made),
the claim fails with one line, and the next try, once the node can write its spec,
prepares it (against the API-server double, on a real host directory)."""

from __future__ import annotations

from pathlib import Path

from conftest import NODE

from gpushare.bench.rig import node_gpus
from gpushare.dra.claimread import ClaimRef
from gpushare.dra.claims import ClaimPreparer
from gpushare.dra.model import offered_devices
from gpushare.gpu.health import HealthBoard
from gpushare.kube.stdlibclient import ApiClient, kubeconfig_endpoint
from gpushare.share.answers import DeviceListing, Enforcement
from gpushare.sim.apidouble import KubeApiDouble
from gpushare.sim.drakubeletdouble import allocated_claim

DRIVER = "gpu.gpushare.io"


def test_a_spec_that_cannot_be_written_leaves_no_cache_directory(
    short_tmp: Path, api: KubeApiDouble
) -> None:
    host, cdi = short_tmp / "vgpu", short_tmp / "cdi"
    gpus = node_gpus(1, 16384)
    offered = offered_devices(gpus, 256, pcie_roots={})
    preparer = ClaimPreparer(
        api=ApiClient(kubeconfig_endpoint(short_tmp / "kubeconfig")),
        driver=DRIVER,
        pool=NODE,
        devices=lambda: {d.name: d for d in offered},
        health=HealthBoard([g.uuid for g in gpus]),
        enforcement=Enforcement(host / "libvgpu.so", None, True, limit_check="/hook"),
        listing=DeviceListing(),
        unit_mib=256,
        host_lib_dir=host,
        cdi_dir=cdi,
        state_dir=short_tmp / "dra",
    )
    capacity = {"memory": "1Gi", "cores": "30"}
    result = {"request": "gpu", "device": "gpu-0", "consumedCapacity": capacity}
    claim = api.add(allocated_claim("default", "c", DRIVER, NODE, [result]))
    ref = ClaimRef("default", "c", claim["metadata"]["uid"])
    cdi.write_text("a file where the CDI directory should be")

    (failed,) = preparer.prepare([ref]).values()
    assert failed.error.startswith("cannot prepare the claim: cannot write the claim's CDI spec")
    assert "\n" not in failed.error
    assert list((host / "containers").glob("d-*")) == []  # made, then released
    assert preparer.held.entries() == []

    cdi.unlink()
    (prepared,) = preparer.prepare([ref]).values()
    assert prepared.error == ""
    (made,) = (host / "containers").glob("d-*")
    assert made.is_dir()
    assert preparer.unprepare([ref]) == {ref.uid: ""}
    assert not made.exists()
