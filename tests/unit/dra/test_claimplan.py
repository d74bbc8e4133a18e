"""One claim's preparation decided without a file system (``dra/claimplan.py``): what
is refused, and for what is granted each result's edits, host side, CDI device and the
checkpoint entry, from plain data (the node's devices, a health board in memory, the
enforcement, the mates). Every path is under a directory that does not exist."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpushare.dra.claimplan import ClaimNode, plan_claim
from gpushare.dra.claimread import ClaimRef, ClaimRefused
from gpushare.dra.mates import Container, Mate, Shares, Together
from gpushare.dra.model import offered_devices
from gpushare.gpu.gpus import Gpu, MigDevice
from gpushare.gpu.health import HealthBoard
from gpushare.host.grants import NodeDirs
from gpushare.host.library import claim_cache_key
from gpushare.share.answers import (
    CONTAINER_CACHE_DIR,
    CONTAINER_MPS_PIPE,
    MEMORY_LIMIT,
    DeviceListing,
    Enforcement,
)

NOWHERE = Path("/nonexistent/gpushare-claim-plan")
UID = "0b5e6e4e-1111-4222-8333-444455556666"
CLAIM = ClaimRef("default", "c", UID)
CARDS = [Gpu(f"GPU-{i}", "NVIDIA H200", 16384, i, minor=i) for i in range(2)]
MIG = MigDevice("MIG-a", "GPU-m", "1g.5gb", 4864, gpu_instance=9, compute_instance=0)
MIG_CARD = Gpu("GPU-m", "NVIDIA A100", 40960, 2, minor=2, mig_enabled=True, mig_devices=(MIG,))
INTERPOSER = Enforcement(
    NOWHERE / "libvgpu.so", None, True, limit_check=str(NOWHERE / "gpushare-memory-hook")
)


def node(enforcement: Enforcement = INTERPOSER, **kw: Any) -> ClaimNode:
    devices = offered_devices([*CARDS, MIG_CARD], 256, pcie_roots={})
    board = HealthBoard(["GPU-0", "GPU-1", "GPU-m", "MIG-a"])
    for key, reason in kw.pop("unhealthy", {}).items():
        board.set(key, False, reason)
    return ClaimNode(
        "node-1",
        "gpu.gpushare.io/claim",
        {d.name: d for d in devices},
        board,
        enforcement,
        DeviceListing(),
        256,
        kw.pop("dirs", NodeDirs(NOWHERE)),
        **kw,
    )


def share(device: str = "gpu-0", memory: str = "1Gi", cores: str = "30") -> dict[str, Any]:
    return {
        "request": "gpu",
        "device": device,
        "consumedCapacity": {"memory": memory, "cores": cores},
    }


def plan(results: list[dict[str, Any]], claim_node: ClaimNode | None = None, **kw: Any) -> Any:
    kw.setdefault("held", [])
    kw.setdefault("applied", lambda uid: None)
    return plan_claim(CLAIM, results, kw.pop("together", Together()), claim_node or node(), **kw)


def test_a_share_plans_its_cache_directory_edits_and_entry() -> None:
    planned = plan([share()])
    (result,) = planned.results
    key = claim_cache_key(UID, "gpu", "gpu-0")
    assert result.needs is not None and result.needs.cache_dir == NOWHERE / "containers" / key
    assert not result.needs.keep
    mounts = {m.container_path: m.host_path for m in result.edits.mounts}
    assert mounts[CONTAINER_CACHE_DIR] == str(result.needs.cache_dir)
    assert result.edits.envs[MEMORY_LIMIT] == "1024m"
    assert any("--check-limits" in h.args for h in result.edits.hooks)
    assert result.cdi.name == f"{UID}-gpu-gpu-0"
    assert result.record.cdi_ids[0] == f"gpu.gpushare.io/claim={UID}-gpu-gpu-0"
    assert (result.record.memory_mib, result.record.cores) == (1024, 30)
    assert planned.entry.cache_keys == [key]
    assert (planned.entry.memory_limit_mib, planned.entry.core_limit) == (1024, 30)
    assert not NOWHERE.exists()


def test_a_recovered_claims_directory_is_kept() -> None:
    key = claim_cache_key(UID, "gpu", "gpu-0")
    (result,) = plan([share()], keep=[key]).results
    assert result.needs is not None and result.needs.keep


def test_an_mps_share_plans_its_own_namespace() -> None:
    on_mps = Enforcement(
        None, None, False, memory={"GPU-0": "soft"}, compute={"GPU-0": "mps"}, mps_pipe=NOWHERE
    )
    root = NOWHERE / "mps" / "pipe" / "gpushare"
    planned = plan([share()], node(on_mps, dirs=NodeDirs(NOWHERE, root), mps=True))
    (result,) = planned.results
    key = claim_cache_key(UID, "gpu", "gpu-0")
    assert result.needs is not None and result.needs.cache_dir is None
    assert result.needs.mps is not None and result.needs.mps.claim
    assert (result.needs.mps.memory_mib, result.needs.mps.cores) == (1024, 30)
    assert result.needs.mps.pinned
    assert result.needs.mps_pipe == root / key
    mounts = {m.container_path: m.host_path for m in result.edits.mounts}
    assert mounts[CONTAINER_MPS_PIPE] == str(root / key)
    assert planned.entry.cache_keys == [key]
    # without namespaces nothing is made for it: the control daemon's pipe is mounted
    (shared,) = plan([share()], node(on_mps, mps=True)).results
    assert shared.needs is not None and shared.needs.nothing
    assert plan([share()], node(on_mps, mps=True)).entry.cache_keys == []


def test_a_mig_device_gets_its_device_nodes_and_nothing_on_the_host() -> None:
    nodes = {"MIG-a": ("/dev/nvidia2", "/dev/nvidia-caps/nvidia-cap84")}
    (name,) = [n for n in node().devices if n.startswith("gpu-2")]
    planned = plan([{"request": "mig", "device": name}], node(mig_nodes=nodes))
    (result,) = planned.results
    assert result.needs is None and planned.entry.cache_keys == []
    assert [d.host_path for d in result.edits.device_specs] == list(nodes["MIG-a"])
    assert result.cdi.device_nodes == tuple(result.edits.device_specs)
    (plain,) = plan([{"request": "mig", "device": name}]).results
    assert plain.edits.device_specs == []


@pytest.mark.parametrize(
    "results,claim_node,why",
    [
        ([share("gpu-9")], None, "'gpu-9' is not one of this node's"),
        ([share("gpu-1")], node(unhealthy={"GPU-1": "XID 79"}), "gpu-1 is unhealthy (XID 79)"),
        ([share(memory="1Ti")], None, "device gpu-0"),
        (
            [share()],
            node(Enforcement(NOWHERE / "libvgpu.so", None, True)),
            "the limit check",
        ),
    ],
)
def test_refusals(results: list[dict[str, Any]], claim_node: ClaimNode | None, why: str) -> None:
    with pytest.raises(ClaimRefused, match="claim default/c") as refused:
        plan(results, claim_node)
    assert why in str(refused.value)


def test_a_mate_prepared_above_the_smallest_share_refuses_the_claim() -> None:
    small = Shares(512, 100)
    mates = (Mate("c", UID, Shares(1024, 100)), Mate("other", "uid-other", small))
    together = Together((Container("default/p", "main", mates),))
    with pytest.raises(ClaimRefused, match="also uses claim other"):
        plan([share()], together=together, applied=lambda uid: Shares(2048, 100))
    planned = plan([share()], together=together, applied=lambda uid: small)
    assert planned.entry.memory_limit_mib == 512  # held to the smallest share there
