"""Every front door answers the same grant with the same edits, and every call of every
door is timed and counted on ``/metrics``: over the real sockets (the kubelet stand-in,
the DRA kubelet stand-in, the metrics HTTP server).

A DRA card and a device-plugin card cannot be the same card at once, so each test
grants the same thing on two cards of the same model (or on the same MIG device, the
node restarted with the card handed to the other door) and compares the edits with
the device named the same way."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import NODE, TESLA_P4, Node, cards, gpu_uuid
from kit.mig_layouts import mig_uuid, reference_a100
from kit.mps import install_standin
from kit.procs import free_port, scrape
from test_metrics import samples
from test_mig_serving import start as start_mig

from gpushare.bench.processes import node_gpus
from gpushare.daemon import Daemon
from gpushare.deviceplugin.binding import Binder
from gpushare.deviceplugin.exclusive import sealed_by
from gpushare.deviceplugin.migserve import exclusive_device, mig_answer
from gpushare.dra.claimread import ClaimRef
from gpushare.dra.claims import ClaimPreparer
from gpushare.dra.model import offered_devices
from gpushare.gpu.gpus import Gpu, MigDevice
from gpushare.gpu.health import HealthBoard
from gpushare.host.grants import GrantHost
from gpushare.host.grantspecs import GrantSpecs
from gpushare.host.mignodes import read_mig_nodes
from gpushare.host.mps import MpsControl, MpsGrants, mps_dirs, mps_shm_dir
from gpushare.kube.stdlibclient import ApiClient, kubeconfig_endpoint
from gpushare.share.answers import (
    CDI_CRI,
    CONTAINER_CACHE_DIR,
    CONTAINER_MPS_PIPE,
    INTERPOSER_INDEXES,
    MEMORY_LIMIT,
    MEMORY_LIMIT_EVERY_INDEX,
    NEUTRAL_SWITCHES,
    DeviceListing,
    DriverHook,
    Enforcement,
    core_limit_env,
    memory_limit_env,
)
from gpushare.share.devices import Inventory, Resource, format_device_id
from gpushare.share.usage import UsageLedger
from gpushare.sim.apidouble import KubeApiDouble
from gpushare.sim.drakubeletdouble import DraKubelet, allocated_claim

DRIVER = "gpu.gpushare.io"
PREFIX = "gpushare.io"
MIG_1G = f"{PREFIX}/mig-1g.5gb"


def dra_settings(node: Node, port: int) -> dict[str, Any]:
    return {
        "node_name": NODE,
        "dra_kubelet_root": str(node.root / "kubelet"),
        "dra_cdi_dir": str(node.root / "cdi"),
        "metrics_port": port,
        "metrics_address": "127.0.0.1",
    }


def prepare(node: Node, api: KubeApiDouble, name: str, result: dict[str, Any]) -> Any:
    """Prepare one claim of one result over the DRA socket; (ref, its CDI edits)."""
    kubelet = DraKubelet(node.root / "kubelet")
    kubelet.register()
    claim = api.add(allocated_claim("default", name, DRIVER, NODE, [result]))
    ref = ("default", name, claim["metadata"]["uid"])
    (answer,) = kubelet.prepare([ref]).values()
    assert answer.error == ""
    spec = json.loads((node.root / "cdi" / f"{DRIVER}-claim_{ref[2]}.json").read_text())
    (device,) = spec["devices"]
    return kubelet, ref, device["containerEdits"]


def cdi_env(edits: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in edits.get("env", []))


def cdi_mounts(edits: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    return {
        m["containerPath"]: (m["hostPath"], m["options"][0] == "ro")
        for m in edits.get("mounts", [])
    }


def plugin_mounts(mounts: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    return {path: (m.host_path, m.read_only) for path, m in mounts.items()}


def counted(text: str, resource: str, method: str) -> float:
    return samples(text).get(
        ("gpushare_request_duration_seconds_count", (("method", method), ("resource", resource))),
        0,
    )


def allocations(text: str, resource: str, result: str = "ok") -> float:
    return samples(text).get(
        ("gpushare_allocations_total", (("resource", resource), ("result", result))), 0
    )


def test_a_share_is_the_same_edits_from_the_two_allocates_and_from_a_claim(
    node: Node, api: KubeApiDouble
) -> None:
    """Memory and cores on a card: the device plugin's two answers, merged as the kubelet
    merges them, and a DRA claim of the same memory and cores on a card of the same
    model give the same environment and mounts (the cache directory is the container's,
    or the claim's, own); both doors' calls are on /metrics."""
    port = free_port()
    node.start(cards(TESLA_P4, 2), card_modes="0=dra", **dra_settings(node, port))
    admitted = node.kubelet.admit("p", "main", {node.memory: 4, node.core: 30})
    assert admitted.card() == gpu_uuid(1)
    unit = node.settings.memory_unit_mib
    kubelet, ref, edits = prepare(
        node,
        api,
        "share",
        {
            "request": "gpu",
            "device": "gpu-0",
            "consumedCapacity": {"memory": f"{4 * unit}Mi", "cores": "30"},
        },
    )
    claim_env = cdi_env(edits)
    assert claim_env.pop("NVIDIA_VISIBLE_DEVICES") == gpu_uuid(0)
    # a claim may show the container several cards: its limit is set for every index too
    # (issue 32 item 2); a device-plugin container sees one card, index 0
    assert claim_env.pop("CUDA_DEVICE_MEMORY_LIMIT") == f"{4 * node.settings.memory_unit_mib}m"
    # and, since its container's own env is not checked (the admission policy cannot
    # tell a gpushare claim), every index HAMi-core reads and its switches at the
    # values that behave as if unset (issue 32 item 1); a device-plugin container's env
    # is checked instead
    for i in range(16):
        assert claim_env.pop(f"CUDA_DEVICE_SM_LIMIT_{i}") == "30"
        if i:
            assert claim_env.pop(f"CUDA_DEVICE_MEMORY_LIMIT_{i}") == f"{4 * unit}m"
    assert claim_env.pop("GPU_CORE_UTILIZATION_POLICY") == "default"
    assert claim_env.pop("CUDA_DISABLE_CONTROL") == "false"
    assert claim_env.pop("CUDA_REDIRECT") == ""
    assert claim_env.pop("ACTIVE_OOM_KILLER") == "true"
    assert claim_env.pop("CUDA_TASK_PRIORITY") == "1"
    plugin_env = dict(admitted.envs)
    assert plugin_env.pop("NVIDIA_VISIBLE_DEVICES") == gpu_uuid(1)
    assert claim_env == plugin_env
    assert plugin_env["CUDA_DEVICE_MEMORY_LIMIT_0"] == f"{4 * unit}m"
    assert plugin_env["CUDA_DEVICE_SM_LIMIT"] == "30"
    claim_mounts = cdi_mounts(edits)
    device_mounts = plugin_mounts(admitted.mounts)
    cache = "/usr/local/vgpu/cache"
    assert claim_mounts.pop(cache)[0] != device_mounts.pop(cache)[0]  # each its own
    assert claim_mounts == device_mounts and claim_mounts  # the interposer, lock, preload

    assert kubelet.unprepare([ref]) == {ref[2]: ""}
    kubelet.close()
    _, text = scrape(port)
    for resource in (node.memory, node.core):
        assert counted(text, resource, "Allocate") >= 1
        assert allocations(text, resource) >= 1
    assert counted(text, DRIVER, "NodePrepareResources") == 1
    assert counted(text, DRIVER, "NodeUnprepareResources") == 1
    assert allocations(text, DRIVER) == 1  # a prepare hands out; an unprepare does not


def test_a_refused_claim_is_counted_as_an_error(node: Node, api: KubeApiDouble) -> None:
    port = free_port()
    node.start(cards(TESLA_P4, 2), card_modes="0=dra", **dra_settings(node, port))
    kubelet = DraKubelet(node.root / "kubelet")
    kubelet.register()
    claim = api.add(
        allocated_claim("default", "ghost", DRIVER, NODE, [{"request": "r", "device": "gpu-9"}])
    )
    (answer,) = kubelet.prepare([("default", "ghost", claim["metadata"]["uid"])]).values()
    kubelet.close()
    assert answer.error
    _, text = scrape(port)
    assert allocations(text, DRIVER, "error") == 1 and allocations(text, DRIVER) == 0


def test_a_mig_device_is_the_same_edits_from_both_doors(node: Node, api: KubeApiDouble) -> None:
    """A 1g.5gb MIG device claimed through DRA, then (the card handed to the device
    plugin) allocated through the MIG resource: the same edits, the raw device; the
    MIG door's calls are on /metrics."""
    start_mig(
        node,
        [reference_a100(), cards(TESLA_P4, 2)[1]],
        card_modes="0=dra",
        mig_strategy="mixed",
        **dra_settings(node, free_port()),
    )
    kubelet, _ref, edits = prepare(
        node, api, "small", {"request": "mig", "device": "gpu-0-mig-9-0"}
    )
    kubelet.close()
    assert node.daemon is not None
    node.daemon.stop()
    port = free_port()
    node.settings = replace(node.settings, card_modes="", metrics_port=port)
    node.daemon = Daemon(node.settings, specs=node.specs)
    node.daemon.start()
    assert node.kubelet.wait_for(lambda k: bool(k.devices(MIG_1G)), 30.0)
    admitted = node.kubelet.admit("p", "main", {MIG_1G: 1})
    (device,) = admitted.devices[MIG_1G]
    assert device in (mig_uuid(2), mig_uuid(3))  # the two 1g.5gb devices
    claim_env = cdi_env(edits)
    assert claim_env == {"NVIDIA_VISIBLE_DEVICES": mig_uuid(2)}
    assert admitted.envs == {"NVIDIA_VISIBLE_DEVICES": device}
    assert cdi_mounts(edits) == plugin_mounts(admitted.mounts) == {}
    _, text = scrape(port)
    assert counted(text, MIG_1G, "Allocate") == 1
    assert allocations(text, MIG_1G) == 1


def test_whole_card_calls_are_timed_and_counted(node: Node) -> None:
    port = free_port()
    node.start(cards(TESLA_P4, 2), whole_cards=True, metrics_port=port, metrics_address="127.0.0.1")
    gpu = f"{PREFIX}/gpu"
    assert node.kubelet.wait_for(lambda k: bool(k.devices(gpu)), 30.0)
    node.kubelet.admit("train", "main", {gpu: 2})
    _, text = scrape(port)
    assert counted(text, gpu, "Allocate") == 1
    assert counted(text, gpu, "GetPreferredAllocation") == 1
    assert allocations(text, gpu) == 1


# --------------------------------------------------------------------------- every backend
#
# The same grant through the device plugin's shared door (two Allocates, memory then
# cores, as the kubelet makes them) and through the DRA door (one claim of the same
# memory and cores), for every enforcement backend of a card, on one host directory: the
# doors' objects as the daemon builds them (``Binder``, ``ClaimPreparer``), each
# planning and applying its grant through ``host/grants.py``. Under a CDI device-list
# strategy both doors' edits ride on a CDI spec of the daemon's own, so what the
# container gets is read back from the specs, and what was made on the host from the
# host directory and the MPS control daemon's stand-in.

UNIT_MIB = 256
MEMORY_UNITS, CORES = 4, 30
CDI_LISTING = DeviceListing(frozenset({CDI_CRI}))
#: what a claim adds to the device plugin's edits: its limits under every index
#: HAMi-core reads and its switches (its container's env is not checked, issue 32)
CLAIM_ONLY_ENV = {
    MEMORY_LIMIT_EVERY_INDEX,
    *(memory_limit_env(i) for i in range(1, INTERPOSER_INDEXES)),
    *(core_limit_env(i) for i in range(INTERPOSER_INDEXES)),
    *NEUTRAL_SWITCHES,
}


def backend_enforcement(backend: str, host: Path, uuids: list[str]) -> Enforcement:
    """The node's enforcement with every card of ``uuids`` under ``backend``."""
    interposer = Enforcement(
        host / "libvgpu.so.0123456789ab",
        host / "ld.so.preload",
        True,
        host / "containers" / "vgpulock",
        limit_check=str(host / "gpushare-memory-hook"),
    )
    hook = DriverHook(str(host / "gpushare-memory-hook"))
    mps_pipe, _log = mps_dirs(host)
    on_mps = {
        "mps_pipe": mps_pipe,
        "mps_shm": mps_shm_dir(host),
        "compute": dict.fromkeys(uuids, "mps"),
    }
    return {
        "interposer": interposer,
        "driver": replace(interposer, memory=dict.fromkeys(uuids, "driver"), driver_hook=hook),
        "mps": replace(
            interposer, memory=dict.fromkeys(uuids, "driver"), driver_hook=hook, **on_mps
        ),
        "soft": replace(interposer, memory=dict.fromkeys(uuids, "soft"), **on_mps),
        "none": Enforcement(None, None, False),
    }[backend]


def spec_edits(cdi_dir: Path, cdi_name: str) -> dict[str, Any]:
    """The containerEdits of the CDI device ``<vendor>/<class>=<name>`` in ``cdi_dir``."""
    kind, name = cdi_name.split("=", 1)
    for path in cdi_dir.glob(f"{kind.replace('/', '-')}_*.json"):
        for device in json.loads(path.read_text())["devices"]:
            if device["name"] == name:
                return dict(device["containerEdits"])
    raise AssertionError(f"no CDI device {cdi_name} in {cdi_dir}")


def merged(*edits: dict[str, Any]) -> dict[str, Any]:
    """Several CDI devices' edits as the runtime applies them to one container."""
    env: dict[str, str] = {}
    mounts: dict[str, Any] = {}
    hooks: list[Any] = []
    for one in edits:
        env.update(cdi_env(one))
        mounts.update({m["containerPath"]: m for m in one.get("mounts", [])})
        hooks += [h for h in one.get("hooks", []) if h not in hooks]
    return {"env": env, "mounts": mounts, "hooks": hooks}


def same_card(edits: dict[str, Any], uuid: str) -> dict[str, Any]:
    """``edits`` with the card's UUID written as ``<card>`` (the doors grant two cards)."""
    return json.loads(json.dumps(edits).replace(uuid, "<card>"))


def _drop_holder(hook: dict[str, Any]) -> Path | None:
    """Take ``--holder DIR`` out of a hook's arguments; DIR, or None."""
    args = hook.get("args", [])
    if "--holder" not in args:
        return None
    at = args.index("--holder")
    holder = Path(args[at + 1])
    hook["args"] = args[:at] + args[at + 2 :]
    return holder


@pytest.mark.parametrize("backend", ["interposer", "driver", "mps", "soft", "none"])
def test_every_backend_gives_the_same_edits_and_host_side_from_both_doors(
    short_tmp: Path, api: KubeApiDouble, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    host, cdi_dir = short_tmp / "vgpu", short_tmp / "cdi"
    gpus = node_gpus(2, 16384)
    uuids = [g.uuid for g in gpus]
    enforcement = backend_enforcement(backend, host, uuids)
    mps = None
    if backend in ("mps", "soft"):
        monkeypatch.setenv("STANDIN_MPS_V3", "1")  # a control daemon with namespaces
        control = MpsControl(install_standin(short_tmp / "bin"), host)
        control.start()
        mps = MpsGrants(control, host)
    try:
        # the device plugin's shared door: card 1, memory then cores
        inventory = Inventory(gpus, UNIT_MIB)
        binder = Binder(
            inventory,
            UsageLedger(inventory),
            HealthBoard(uuids),
            policy="binpack",
            enforcement=enforcement,
            host_lib_dir=host,
            listing=CDI_LISTING,
            grant_specs=GrantSpecs(cdi_dir, PREFIX, 60.0),
            mps=mps,
        )
        units = {
            Resource.MEMORY: [format_device_id(uuids[1], n) for n in range(MEMORY_UNITS)],
            Resource.CORE: [format_device_id(uuids[1], n) for n in range(CORES)],
        }
        answers = [binder.allocate(r, ids)[1] for r, ids in units.items()]
        grant_names = [n for a in answers for n in a.cdi_devices if "/grant=" in n]
        assert all(a.envs == {} and a.mounts == [] for a in answers)  # sealed: in the specs
        plugin = merged(*(spec_edits(cdi_dir, n) for n in grant_names))

        # the DRA door: a claim of the same memory and cores on card 0
        offered = offered_devices(gpus, UNIT_MIB, pcie_roots={})
        preparer = ClaimPreparer(
            api=ApiClient(kubeconfig_endpoint(short_tmp / "kubeconfig")),
            driver=DRIVER,
            pool=NODE,
            devices=lambda: {d.name: d for d in offered},
            health=HealthBoard(uuids),
            enforcement=enforcement,
            listing=CDI_LISTING,
            unit_mib=UNIT_MIB,
            host_lib_dir=host,
            cdi_dir=cdi_dir,
            state_dir=short_tmp / "dra",
            mps=mps,
        )
        capacity = {"memory": f"{MEMORY_UNITS * UNIT_MIB}Mi", "cores": str(CORES)}
        claim = api.add(
            allocated_claim(
                "default",
                "share",
                DRIVER,
                NODE,
                [{"request": "gpu", "device": "gpu-0", "consumedCapacity": capacity}],
            )
        )
        ref = ClaimRef("default", "share", claim["metadata"]["uid"])
        (outcome,) = preparer.prepare([ref]).values()
        assert outcome.error == ""
        (device,) = outcome.devices
        claim_edits = spec_edits(cdi_dir, device.cdi_ids[0])
        dra = merged(claim_edits)

        # the same names for the same card, beside the grant's own CDI device
        assert [n.replace(uuids[0], "<card>") for n in device.cdi_ids[1:]] == [
            n.replace(uuids[1], "<card>")
            for a in answers
            for n in a.cdi_devices
            if n not in grant_names
        ][:1]

        # the same environment, but what a claim sets for every index
        memory = dra["env"].get(MEMORY_LIMIT)
        for name in CLAIM_ONLY_ENV & set(dra["env"]):
            value = dra["env"].pop(name)
            assert value in (memory, str(CORES), NEUTRAL_SWITCHES.get(name)), name
        assert dra["env"] == plugin["env"]

        # the same hooks (the card's UUID aside), but the claim's limit check, and the
        # claim's holder directory on a driver card (one live container per claim share,
        # docs/dra.md: a device-plugin grant is one container's already)
        claim_hooks = [h for h in dra["hooks"] if "--check-limits" not in h.get("args", [])]
        holders = [_drop_holder(h) for h in claim_hooks]
        assert same_card(claim_hooks, uuids[0]) == same_card(plugin["hooks"], uuids[1])
        if backend in ("driver", "mps"):
            assert claim_hooks  # the driver's memory hook, through both doors
            (holder,) = [h for h in holders if h is not None]
            assert holder.is_dir() and holder.stat().st_mode & 0o777 == 0o700
            assert not any("--holder" in h.get("args", []) for h in plugin["hooks"])
        else:
            assert holders == [None] * len(holders)

        # the same mounts; the cache directory or MPS namespace each its own, made on the
        # host before the answer left, in the same place
        for path in (CONTAINER_CACHE_DIR, CONTAINER_MPS_PIPE):
            assert (path in dra["mounts"]) == (path in plugin["mounts"]), path
            if path in dra["mounts"]:
                ours, theirs = dra["mounts"].pop(path), plugin["mounts"].pop(path)
                assert ours["options"] == theirs["options"]
                mine, other = Path(ours["hostPath"]), Path(theirs["hostPath"])
                assert mine != other and mine.parent == other.parent
                assert mine.is_dir() and other.is_dir() and not mine.is_symlink()
        assert dra["mounts"] == plugin["mounts"]
        expect_cache = backend in ("interposer",)
        assert (CONTAINER_CACHE_DIR in cdi_mounts(claim_edits)) == expect_cache

        # the same MPS namespace caps, made before either answer left
        if mps is not None:
            caps = mps.control.caps()
            assert len(caps) == 2
            (plugin_cap,) = [c for n, c in caps.items() if not n.startswith("d-")]
            (claim_cap,) = [c for n, c in caps.items() if n.startswith("d-")]
            pinned = MEMORY_UNITS * UNIT_MIB if backend == "soft" else None
            assert (plugin_cap.percent, plugin_cap.memory_mib) == (CORES, pinned)
            assert (claim_cap.percent, claim_cap.memory_mib) == (CORES, pinned)
            assert plugin_cap.marker.is_dir() and claim_cap.marker.is_dir()

        # undone: the claim's directories go at unprepare (the device plugin's with its
        # units, by the garbage collector), its spec too
        made = list((host / "containers").glob("d-*"))
        assert bool(made) == (backend in ("interposer", "mps", "soft"))
        assert preparer.unprepare([ref]) == {ref.uid: ""}
        assert not any(p.exists() for p in made)
        assert not list(cdi_dir.glob(f"{DRIVER.replace('/', '-')}-claim_*.json"))
    finally:
        if mps is not None:
            mps.control.stop()


def test_a_mig_device_gets_the_same_device_nodes_from_both_doors(
    short_tmp: Path, api: KubeApiDouble
) -> None:
    """``hardware``: a MIG device, with ``--mig-device-specs``: both doors pass the
    device nodes read from the host (one reading, ``host/mignodes.py``): the MIG door in
    its answer, the DRA door in the claim's CDI spec."""
    mig = MigDevice("MIG-0a", gpu_uuid(0), "1g.5gb", 4864, gpu_instance=9, compute_instance=0)
    card = Gpu(gpu_uuid(0), "NVIDIA A100", 40960, 0, minor=0, mig_enabled=True, mig_devices=(mig,))
    minors = short_tmp / "mig-minors"
    minors.write_text("gpu0/gi9/access 84\ngpu0/gi9/ci0/access 85\n")
    nodes = read_mig_nodes([card], [mig], minors, short_tmp / "dev")
    assert nodes == {
        mig.uuid: ("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap84", "/dev/nvidia-caps/nvidia-cap85")
    }

    host = GrantHost.of(
        short_tmp / "vgpu", specs=GrantSpecs(short_tmp / "cdi", PREFIX, 60.0), listing=CDI_LISTING
    )
    answer = sealed_by(mig_answer(CDI_LISTING, specs=nodes), MIG_1G, host)
    plugin = answer([exclusive_device({card.uuid: card}, mig)])
    plugin_nodes = [d.host_path for d in plugin.device_specs]

    offered = offered_devices([card], UNIT_MIB, pcie_roots={})
    preparer = ClaimPreparer(
        api=ApiClient(kubeconfig_endpoint(short_tmp / "kubeconfig")),
        driver=DRIVER,
        pool=NODE,
        devices=lambda: {d.name: d for d in offered},
        health=HealthBoard([card.uuid, mig.uuid]),
        enforcement=Enforcement(None, None, False),
        listing=CDI_LISTING,
        unit_mib=UNIT_MIB,
        host_lib_dir=short_tmp / "vgpu",
        cdi_dir=short_tmp / "cdi",
        state_dir=short_tmp / "dra",
        mig_nodes=nodes,
    )
    (name,) = [d.name for d in offered]
    claim = api.add(
        allocated_claim("default", "small", DRIVER, NODE, [{"request": "mig", "device": name}])
    )
    ref = ClaimRef("default", "small", claim["metadata"]["uid"])
    (outcome,) = preparer.prepare([ref]).values()
    assert outcome.error == ""
    edits = spec_edits(short_tmp / "cdi", outcome.devices[0].cdi_ids[0])
    claim_nodes = [d["hostPath"] for d in edits["deviceNodes"]]
    assert claim_nodes == plugin_nodes == list(nodes[mig.uuid])
    assert [d["path"] for d in edits["deviceNodes"]] == claim_nodes
