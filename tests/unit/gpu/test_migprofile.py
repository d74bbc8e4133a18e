"""MIG profile naming: the lists NVIDIA prints for A100-40GB and H100-80GB, every NVML
profile index, the GB formula against exact arithmetic, and the resource names."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushare.gpu.migprofile import (
    COMPUTE_INSTANCE_PROFILES,
    GPU_INSTANCE_PROFILES,
    MigProfile,
    ProfileError,
    memory_gb,
    parse_profile,
    profile_of,
    resource_suffix,
)

MIB = 1 << 20

# (GPU-instance enum index, instance MiB, expected name). Instance sizes as NVML
# reports them on real cards (nvidia-smi mig -lgip: 4.75 GiB, 9.75 GiB, ...) and as
# NVIDIA's mock NVML (go-nvml pkg/nvml/mock/gpus) holds them.
# Instance MiB as real cards report them (nvidia-smi mig -lgip: 4.75 GiB, 9.75 GiB, ...),
# with the totals real cards report; and NVIDIA's mock NVML's figures (go-nvml
# pkg/nvml/mock/gpus) with the mock's round totals.
A100_REAL = (
    (40536, 40960),
    [(0, 4864, "1g.5gb"), (7, 4864, "1g.5gb+me"), (9, 9984, "1g.10gb"), (1, 9984, "2g.10gb"),
     (2, 20096, "3g.20gb"), (3, 20096, "4g.20gb"), (4, 40448, "7g.40gb")],
)
A100_MOCK = (
    (40960,),
    [(0, 4864, "1g.5gb"), (7, 4864, "1g.5gb+me"), (9, 9856, "1g.10gb"), (1, 9856, "2g.10gb"),
     (2, 19968, "3g.20gb"), (3, 19968, "4g.20gb"), (4, 40192, "7g.40gb")],
)
H100_REAL = (
    (81559, 81920),
    [(0, 9984, "1g.10gb"), (7, 9984, "1g.10gb+me"), (9, 20096, "1g.20gb"), (1, 20096, "2g.20gb"),
     (2, 40448, "3g.40gb"), (3, 40448, "4g.40gb"), (4, 81152, "7g.80gb")],
)
H100_MOCK = (
    (81920,),
    [(0, 10240, "1g.10gb"), (7, 10240, "1g.10gb+me"), (9, 20480, "1g.20gb"),
     (1, 20480, "2g.20gb"), (2, 40960, "3g.40gb"), (3, 40960, "4g.40gb"), (4, 81920, "7g.80gb")],
)


def cases(*tables: tuple[tuple[int, ...], list[tuple[int, int, str]]]) -> list[tuple[int, ...]]:
    return [(t, gi, mib, name) for totals, rows in tables for t in totals for gi, mib, name in rows]


#: The compute-instance profile index that fills each GPU-instance profile.
FULL_CI = {0: 0, 1: 1, 2: 2, 3: 3, 4: 4, 7: 0, 9: 0}


@pytest.mark.parametrize(("total_mib", "gi", "mib", "name"), cases(A100_REAL, A100_MOCK))
def test_a100_40gb_profiles(total_mib: int, gi: int, mib: int, name: str) -> None:
    assert str(profile_of(gi, FULL_CI[gi], mib, total_mib * MIB)) == name


@pytest.mark.parametrize(("total_mib", "gi", "mib", "name"), cases(H100_REAL, H100_MOCK))
def test_h100_80gb_profiles(total_mib: int, gi: int, mib: int, name: str) -> None:
    assert str(profile_of(gi, FULL_CI[gi], mib, total_mib * MIB)) == name


def test_the_issue_lists_are_covered() -> None:
    assert {n for _, _, n in A100_REAL[1]} >= {"1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb"}
    assert {n for _, _, n in H100_REAL[1]} >= {
        "1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"
    }


def test_compute_slices_show_only_when_they_differ() -> None:
    total = 40960 * MIB
    assert str(profile_of(1, 0, 9856, total)) == "1c.2g.10gb"  # 1-slice CI in a 2g GI
    assert str(profile_of(4, 2, 40192, total)) == "3c.7g.40gb"
    assert str(profile_of(4, 4, 40192, total)) == "7g.40gb"
    assert str(profile_of(7, 7, 4864, total)) == "1g.5gb+me"  # CI 1_SLICE_REV1: one slice


def test_variant_suffixes() -> None:
    total = 81920 * MIB
    assert str(profile_of(15, 0, 10240, total)) == "1g.10gb+me.all"
    assert str(profile_of(13, 0, 10240, total)) == "1g.10gb-me"
    assert str(profile_of(12, 3, 40960, total)) == "4g.40gb+gfx"
    assert str(profile_of(11, 0, 20480, total)) == "1c.2g.20gb+gfx"


def test_every_nvml_profile_pair_names_round_trip_and_make_a_resource_name() -> None:
    totals = [t * MIB for t in (40536, 40960, 81559, 81920, 143771, 24259)]
    for gi, ci in itertools.product(GPU_INSTANCE_PROFILES, COMPUTE_INSTANCE_PROFILES):
        for total in totals:
            for eighths in range(1, 9):
                mib = total * eighths // 8 // MIB
                profile = profile_of(gi, ci, mib, total)
                name = str(profile)
                assert parse_profile(name) == profile, name
                suffix = resource_suffix(name)
                assert "+" not in suffix and suffix.startswith("mig-")
                assert len(suffix) <= 63


def test_unknown_profile_indices_are_refused() -> None:
    with pytest.raises(ProfileError, match="GPU instance profile index 18"):
        profile_of(18, 0, 4864, 40960 * MIB)
    with pytest.raises(ProfileError, match="compute instance profile index 9"):
        profile_of(0, 9, 4864, 40960 * MIB)
    with pytest.raises(ProfileError):
        memory_gb(0, 40960 * MIB)


def exact_gb(instance_mib: int, total: int) -> int:
    """The formula in exact arithmetic; half rounds away from zero."""
    eighths = math.ceil(Fraction(instance_mib * MIB * 8, total))
    value = Fraction(eighths, 8) * ((total + (1 << 30) - 1) // (1 << 30))
    return math.floor(value + Fraction(1, 2))


@given(
    total=st.integers(min_value=1 << 20, max_value=1 << 45),
    share=st.fractions(min_value=Fraction(1, 64), max_value=1),
)
def test_memory_gb_equals_exact_arithmetic(total: int, share: Fraction) -> None:
    mib = max(1, int(share * total) // MIB)
    assert memory_gb(mib, total) == exact_gb(mib, total)


def test_half_rounds_away_from_zero_as_go_does() -> None:
    # A 12 GiB card, an eighth of it: 1.5 GB -> 2 (Python's round() would say 2 here,
    # but 2.5 -> 3 where round() says 2).
    assert memory_gb(12 * 1024 // 8, 12 << 30) == 2
    assert memory_gb(20 * 1024 // 8, 20 << 30) == 3


@pytest.mark.parametrize(
    "text",
    ["", "3g", "3g.20", "0g.5gb", "1g.05gb", "1c.1g", "1g.5gb+", "1g.5gb+me,me", "1g.5gb+1x",
     "1g.5gb +me", "g.5gb", "1g.5gb+me-gfx", "MIG 1g.5gb", "1g.5GB"],
)
def test_parse_refuses_what_is_not_a_profile(text: str) -> None:
    with pytest.raises(ProfileError):
        parse_profile(text)


def test_parse_reads_the_forms_nvidia_prints() -> None:
    assert parse_profile("3g.20gb") == MigProfile(3, 3, 20)
    assert parse_profile("1c.3g.20gb") == MigProfile(1, 3, 20)
    assert parse_profile("1g.10gb+me") == MigProfile(1, 1, 10, ("me",))
    assert parse_profile("1g.10gb-me") == MigProfile(1, 1, 10, (), ("me",))


def test_resource_names() -> None:
    assert resource_suffix("3g.20gb") == "mig-3g.20gb"
    assert resource_suffix("1g.10gb+me") == "mig-1g.10gb.me"
    assert resource_suffix("1g.10gb+me.all") == "mig-1g.10gb.me.all"
    assert resource_suffix("1g.10gb-me") == "mig-1g.10gb-me"
    with pytest.raises(ProfileError, match="no valid resource name"):
        resource_suffix("1g.10gb+me,gfx")
