"""The answer port (``share/answers.container_edits``): one grant, one set of edits.

A share of both limits answers what the device plugin's two per-resource answers give
once the kubelet has merged them (the first value wins); whole devices get the raw
devices or, with enforcement, 100 % limits; the listing names them; hooks are carried
to the CDI spec unchanged."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from gpushare.host.cdi import claim_device, spec_json
from gpushare.share import answers
from gpushare.share.answers import (
    CDI_CRI,
    CONTAINER_CACHE_DIR,
    CONTAINER_LIBRARY,
    DeviceListing,
    Enforcement,
    GrantedDevice,
    Hook,
    container_edits,
    with_device_list,
)

UUID = "GPU-00000000-0000-4000-8000-000000000000"
ENFORCEMENTS = st.sampled_from(
    [
        Enforcement(library=None, preload_file=None, use_ld_preload_env=False),
        Enforcement(Path("/h/libvgpu.so.1"), None, True, Path("/h/lock")),
        Enforcement(Path("/h/libvgpu.so.1"), Path("/h/preload"), False, Path("/h/lock")),
    ]
)


def merged(*envs: dict[str, str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for env in envs:
        for key, value in env.items():
            found.setdefault(key, value)
    return found


@given(
    memory=st.integers(1, 400),
    cores=st.integers(1, 100),
    unit=st.sampled_from([128, 256, 1024]),
    enforcement=ENFORCEMENTS,
)
def test_one_grant_answers_what_the_two_allocates_merge_to(
    memory: int, cores: int, unit: int, enforcement: Enforcement
) -> None:
    cache = Path("/h/cache/c1")
    first = container_edits(
        answers.share(UUID, enforcement=enforcement, memory_mib=memory * unit, cache_dir=cache)
    )
    second = container_edits(answers.share(UUID, enforcement=enforcement, cores=cores))
    both = container_edits(
        answers.share(
            UUID, enforcement=enforcement, memory_mib=memory * unit, cores=cores, cache_dir=cache
        )
    )
    assert both.envs == merged(first.envs, second.envs)
    assert {m.container_path: m for m in both.mounts} == {
        m.container_path: m for m in [*second.mounts, *first.mounts]
    }
    # what both answers set is identical (the kubelet only logs a differing second value)
    for key in first.envs.keys() & second.envs.keys():
        assert first.envs[key] == second.envs[key]
    assert both.envs.get("CUDA_DEVICE_MEMORY_LIMIT_0") == f"{memory * unit}m"
    assert both.envs.get("CUDA_DEVICE_SM_LIMIT") == str(cores)
    assert "CUDA_DEVICE_MEMORY_LIMIT_0" not in second.envs
    assert "CUDA_DEVICE_SM_LIMIT" not in first.envs
    if enforcement.library is not None:
        assert any(m.container_path == CONTAINER_CACHE_DIR for m in both.mounts)
    else:
        assert both.mounts == [] and answers.ANNOTATION_NO_ENFORCEMENT in both.annotations


def test_the_port_names_the_card_as_the_listing_says() -> None:
    enforcement = Enforcement(Path("/h/libvgpu.so.1"), None, True)
    listing = DeviceListing(strategies=frozenset({CDI_CRI}))
    plain = container_edits(answers.share(UUID, enforcement=enforcement, cores=30))
    named = container_edits(
        answers.share(UUID, enforcement=enforcement, cores=30, cdi_id="0"), listing
    )
    assert named == with_device_list(plain, [UUID], listing, ["0"])
    assert named.cdi_devices == ["nvidia.com/gpu=0"]
    assert named.envs["NVIDIA_VISIBLE_DEVICES"] == "void"


@given(
    sizes=st.lists(st.integers(1, 200_000), min_size=1, max_size=8),
    enforcement=st.one_of(st.none(), ENFORCEMENTS),
)
def test_whole_devices_are_raw_or_held_to_their_whole_size(
    sizes: list[int], enforcement: Enforcement | None
) -> None:
    devices = [GrantedDevice(f"GPU-{i}", memory_mib=mib) for i, mib in enumerate(sizes)]
    edits = container_edits(answers.whole(devices, enforcement=enforcement))
    assert edits.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(d.id for d in devices)
    assert edits.annotations == {} and edits.hooks == []
    if enforcement is None or enforcement.library is None:
        assert edits.envs == {"NVIDIA_VISIBLE_DEVICES": ",".join(d.id for d in devices)}
        assert edits.mounts == []
        return
    assert edits.envs["CUDA_DEVICE_SM_LIMIT"] == "100"
    for i, mib in enumerate(sizes):
        assert edits.envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] == f"{mib}m"
    assert f"CUDA_DEVICE_MEMORY_LIMIT_{len(sizes)}" not in edits.envs
    assert edits.mounts[0].container_path == CONTAINER_LIBRARY
    assert CONTAINER_CACHE_DIR not in {m.container_path for m in edits.mounts}


def test_device_nodes_are_passed_once_in_order() -> None:
    devices = [
        GrantedDevice("MIG-a", nodes=("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap1")),
        GrantedDevice("MIG-b", nodes=("/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap2")),
    ]
    edits = container_edits(answers.whole(devices))
    assert [d.host_path for d in edits.device_specs] == [
        "/dev/nvidia0",
        "/dev/nvidia-caps/nvidia-cap1",
        "/dev/nvidia-caps/nvidia-cap2",
    ]
    assert all(
        d.container_path == d.host_path and d.permissions == "rw" for d in edits.device_specs
    )


def test_hooks_reach_the_claims_cdi_spec_and_none_add_nothing() -> None:
    enforcement = Enforcement(Path("/h/libvgpu.so.1"), None, True)
    edits = container_edits(answers.share(UUID, enforcement=enforcement, memory_mib=1024))
    plain = spec_json("x.io/claim", [claim_device("c", edits)])
    assert "hooks" not in plain["devices"][0]["containerEdits"]  # type: ignore[index]
    hook = Hook("createRuntime", "/usr/bin/check", ("check", "--card", UUID))
    hooked = spec_json("x.io/claim", [claim_device("c", replace(edits, hooks=[hook]))])
    assert hooked["devices"][0]["containerEdits"]["hooks"] == [  # type: ignore[index]
        {"hookName": "createRuntime", "path": "/usr/bin/check", "args": list(hook.args)}
    ]


@given(
    memory=st.one_of(st.none(), st.integers(1, 40000)),
    cores=st.one_of(st.none(), st.integers(1, 100)),
    enforcement=ENFORCEMENTS,
    memory_backend=st.sampled_from(["interposer", "driver"]),
    compute_backend=st.sampled_from(["interposer", "none"]),
)
def test_an_every_index_share_sets_each_limit_it_holds_for_every_index(
    memory: int | None,
    cores: int | None,
    enforcement: Enforcement,
    memory_backend: str,
    compute_backend: str,
) -> None:
    """A DRA claim's share (``every_index``): wherever the interposer holds a limit, that
    limit is set for every index HAMi-core reads (0-15) with the grant's own value, and
    its switches at their documented defaults; nothing where it holds none (issue 32
    item 1: the container's own env is not checked, the CDI spec replaces by name)."""
    enforcement = replace(
        enforcement,
        memory={} if memory_backend == "interposer" else {UUID: memory_backend},
        compute={} if compute_backend == "interposer" else {UUID: compute_backend},
        driver_hook=answers.DriverHook("/h/hook"),
    )
    grant = answers.share(
        UUID, enforcement=enforcement, memory_mib=memory, cores=cores, every_index=True
    )
    envs = container_edits(grant).envs
    plain = container_edits(replace(grant, every_index=False)).envs
    loaded = answers.CONTAINER_LIBRARY in {m.container_path for m in container_edits(grant).mounts}
    memory_held = loaded and memory is not None and memory_backend == "interposer"
    cores_held = loaded and cores is not None and compute_backend == "interposer"
    for i in range(answers.INTERPOSER_INDEXES):
        unsealed = plain.get(f"CUDA_DEVICE_MEMORY_LIMIT_{i}")  # _0: advisory without the library
        expected = f"{memory}m" if memory_held else unsealed
        assert envs.get(f"CUDA_DEVICE_MEMORY_LIMIT_{i}") == expected
        assert envs.get(f"CUDA_DEVICE_SM_LIMIT_{i}") == (str(cores) if cores_held else None)
    assert "CUDA_DEVICE_MEMORY_LIMIT_16" not in envs
    switches = {
        "GPU_CORE_UTILIZATION_POLICY": "default",
        "CUDA_DISABLE_CONTROL": "false",
        "CUDA_REDIRECT": "",
        "ACTIVE_OOM_KILLER": "true",
        "CUDA_TASK_PRIORITY": "1",
    }
    assert {k: envs.get(k) for k in switches} == (
        switches if loaded else dict.fromkeys(switches)
    )
    # a device-plugin share (not every_index) is unchanged: its env is checked instead
    assert not any(k in plain for k in (*switches, "CUDA_DEVICE_SM_LIMIT_0"))
