"""The enforcement port: one Grant of both limits answers what the device plugin's two
per-resource answers give once the kubelet has merged them (the first value wins)."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from gpushare.share.answers import (
    CDI_CRI,
    CONTAINER_CACHE_DIR,
    DeviceListing,
    Enforcement,
    Grant,
    build_answer,
    enforcement_answer,
    with_device_list,
)
from gpushare.share.devices import Resource

UUID = "GPU-00000000-0000-4000-8000-000000000000"
ENFORCEMENTS = st.sampled_from(
    [
        Enforcement(library=None, preload_file=None, use_ld_preload_env=False),
        Enforcement(Path("/h/libvgpu.so.1"), None, True, Path("/h/lock")),
        Enforcement(Path("/h/libvgpu.so.1"), Path("/h/preload"), False, Path("/h/lock")),
    ]
)


def merged(*answers: dict[str, str]) -> dict[str, str]:
    envs: dict[str, str] = {}
    for answer in answers:
        for key, value in answer.items():
            envs.setdefault(key, value)
    return envs


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
    first = build_answer(
        Resource.MEMORY,
        UUID,
        memory,
        memory_unit_mib=unit,
        enforcement=enforcement,
        cache_dir=cache,
    )
    second = build_answer(Resource.CORE, UUID, cores, memory_unit_mib=unit, enforcement=enforcement)
    both = enforcement_answer(
        Grant(UUID, memory_mib=memory * unit, cores=cores), enforcement=enforcement, cache_dir=cache
    )
    assert both.envs == merged(first.envs, second.envs)
    assert {m.container_path: m for m in both.mounts} == {
        m.container_path: m for m in [*second.mounts, *first.mounts]
    }
    assert both.envs.get("CUDA_DEVICE_MEMORY_LIMIT_0") == f"{memory * unit}m"
    assert both.envs.get("CUDA_DEVICE_SM_LIMIT") == str(cores)
    if enforcement.library is not None:
        assert any(m.container_path == CONTAINER_CACHE_DIR for m in both.mounts)


def test_the_port_names_the_card_as_the_listing_says() -> None:
    enforcement = Enforcement(Path("/h/libvgpu.so.1"), None, True)
    listing = DeviceListing(strategies=frozenset({CDI_CRI}))
    plain = enforcement_answer(Grant(UUID, cores=30), enforcement=enforcement)
    named = enforcement_answer(
        Grant(UUID, cores=30), enforcement=enforcement, listing=listing, cdi_id="0"
    )
    assert named == with_device_list(plain, [UUID], listing, ["0"])
    assert named.cdi_devices == ["nvidia.com/gpu=0"]
    assert named.envs["NVIDIA_VISIBLE_DEVICES"] == "void"
