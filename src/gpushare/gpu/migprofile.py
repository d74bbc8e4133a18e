"""MIG profile names as NVIDIA's tools print them, and the resource names made from them.

Pure functions over numbers NVML reports; no NVML here.

A profile reads ``<G>g.<GB>gb`` (``3g.20gb``), or ``<C>c.<G>g.<GB>gb`` when the compute
instance holds fewer slices than its GPU instance (``1c.2g.10gb``), with a suffix for the
GPU-instance profile's variant: ``+me`` (media extensions), ``+me.all``, ``+gfx``, or
``-me`` (without media extensions).

The figures are derived as NVIDIA's go-nvlib does (``pkg/nvlib/device/mig_profile.go``,
``NewMigProfile`` and ``getMigMemorySizeGB``; the facts, not the code): ``G`` and the
suffix come from the GPU-instance profile's NVML enum index (``NVML_GPU_INSTANCE_PROFILE_*``),
``C`` from the compute-instance profile's, and ``GB`` from the MIG device's memory
(``nvmlDeviceGetAttributes().memorySizeMB``) relative to the parent card's total:
the fraction of the card, rounded up to eighths, times the card's size in whole GiB
(rounded up), rounded half away from zero. A100-40GB: 4864 MiB -> ``1g.5gb``.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

#: NVML_GPU_INSTANCE_PROFILE_<n> enum index -> (GPU slices, attribute, negated attribute).
GPU_INSTANCE_PROFILES: dict[int, tuple[int, str, str]] = {
    0: (1, "", ""),  # 1_SLICE
    1: (2, "", ""),  # 2_SLICE
    2: (3, "", ""),  # 3_SLICE
    3: (4, "", ""),  # 4_SLICE
    4: (7, "", ""),  # 7_SLICE
    5: (8, "", ""),  # 8_SLICE
    6: (6, "", ""),  # 6_SLICE
    7: (1, "me", ""),  # 1_SLICE_REV1
    8: (2, "me", ""),  # 2_SLICE_REV1
    9: (1, "", ""),  # 1_SLICE_REV2 (H100: 1g.20gb)
    10: (1, "gfx", ""),  # 1_SLICE_GFX
    11: (2, "gfx", ""),  # 2_SLICE_GFX
    12: (4, "gfx", ""),  # 4_SLICE_GFX
    13: (1, "", "me"),  # 1_SLICE_NO_ME
    14: (2, "", "me"),  # 2_SLICE_NO_ME
    15: (1, "me.all", ""),  # 1_SLICE_ALL_ME
    16: (2, "me.all", ""),  # 2_SLICE_ALL_ME
    17: (3, "gfx", ""),  # 3_SLICE_GFX (newer than go-nvlib's table; named by analogy)
}

#: NVML_COMPUTE_INSTANCE_PROFILE_<n> enum index -> compute slices.
COMPUTE_INSTANCE_PROFILES: dict[int, int] = {
    0: 1,  # 1_SLICE
    1: 2,  # 2_SLICE
    2: 3,  # 3_SLICE
    3: 4,  # 4_SLICE
    4: 7,  # 7_SLICE
    5: 8,  # 8_SLICE
    6: 6,  # 6_SLICE
    7: 1,  # 1_SLICE_REV1
    8: 7,  # 7_SLICE_NVL
}

_MIB = 1 << 20
_GIB = 1 << 30

#: ``[<C>c.]<G>g.<GB>gb`` then ``+attr[,attr]`` or ``-attr[,attr]``; attributes are
#: letters and digits, dotted (``me.all``), not starting with a digit.
_ATTRIBUTE = r"[A-Za-z][A-Za-z0-9]*(?:\.[A-Za-z][A-Za-z0-9]*)*"
_PROFILE_RE = re.compile(
    rf"^(?:(?P<c>[1-9][0-9]*)c\.)?(?P<g>[1-9][0-9]*)g\.(?P<gb>[1-9][0-9]*)gb"
    rf"(?:(?P<sign>[+-])(?P<attrs>{_ATTRIBUTE}(?:,{_ATTRIBUTE})*))?$"
)

#: Kubernetes' qualified-name rule for the part after the prefix of a resource name.
_RESOURCE_NAME_RE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


class ProfileError(ValueError):
    """The numbers or the text do not make a MIG profile."""


@dataclass(frozen=True)
class MigProfile:
    """One MIG profile: compute slices, GPU slices, memory in GB, attributes."""

    compute_slices: int
    gpu_slices: int
    memory_gb: int
    attributes: tuple[str, ...] = ()
    negated: tuple[str, ...] = ()

    def __str__(self) -> str:
        suffix = ""
        if self.attributes:
            suffix = "+" + ",".join(self.attributes)
        if self.negated:  # as go-nvlib prints it: a negated attribute wins
            suffix = "-" + ",".join(self.negated)
        head = f"{self.gpu_slices}g.{self.memory_gb}gb"
        if self.compute_slices != self.gpu_slices:
            head = f"{self.compute_slices}c.{head}"
        return head + suffix


def _round_half_away(value: float) -> int:
    """Go's ``math.Round`` for a non-negative value (Python's ``round`` rounds half to even)."""
    whole = math.floor(value)
    return int(whole) + (1 if value - whole >= 0.5 else 0)


def memory_gb(instance_mib: int, parent_total_bytes: int) -> int:
    """The ``GB`` figure of a profile, in float64 steps as go-nvlib computes it."""
    if instance_mib <= 0 or parent_total_bytes <= 0:
        raise ProfileError(
            f"memory must be positive (instance {instance_mib} MiB, card {parent_total_bytes} B)"
        )
    fraction = (float(instance_mib) * _MIB) / float(parent_total_bytes)
    fraction = math.ceil(fraction * 8) / 8
    card_gb = float((parent_total_bytes + _GIB - 1) // _GIB)
    return _round_half_away(fraction * card_gb)


def profile_of(
    gpu_instance_profile: int,
    compute_instance_profile: int,
    instance_mib: int,
    parent_total_bytes: int,
) -> MigProfile:
    """The profile of a MIG device from NVML's enum indices and memory figures."""
    gi = GPU_INSTANCE_PROFILES.get(gpu_instance_profile)
    if gi is None:
        raise ProfileError(f"unknown GPU instance profile index {gpu_instance_profile}")
    ci = COMPUTE_INSTANCE_PROFILES.get(compute_instance_profile)
    if ci is None:
        raise ProfileError(f"unknown compute instance profile index {compute_instance_profile}")
    gpu_slices, attribute, negated = gi
    return MigProfile(
        compute_slices=ci,
        gpu_slices=gpu_slices,
        memory_gb=memory_gb(instance_mib, parent_total_bytes),
        attributes=(attribute,) if attribute else (),
        negated=(negated,) if negated else (),
    )


def parse_profile(text: str) -> MigProfile:
    """``"1c.2g.10gb+me"`` -> its :class:`MigProfile`; else :class:`ProfileError`."""
    match = _PROFILE_RE.match(text)
    if match is None:
        raise ProfileError(
            f"{text[:40]!r} is not a MIG profile like 3g.20gb, 1c.2g.10gb or 1g.10gb+me"
        )
    gpu_slices = int(match["g"])
    compute = int(match["c"]) if match["c"] else gpu_slices
    attrs = tuple(match["attrs"].split(",")) if match["attrs"] else ()
    if len(set(attrs)) != len(attrs):
        raise ProfileError(f"{text[:40]!r} repeats an attribute")
    plus = match["sign"] == "+"
    return MigProfile(
        compute_slices=compute,
        gpu_slices=gpu_slices,
        memory_gb=int(match["gb"]),
        attributes=attrs if plus else (),
        negated=() if plus else attrs,
    )


def resource_suffix(profile: str) -> str:
    """The resource name of a profile without its prefix: ``mig-<profile>``, ``+`` -> ``.``
    (as NVIDIA's plugin names them in its mixed strategy: ``mig-1g.10gb.me``).

    Raises :class:`ProfileError` when the result is not a valid Kubernetes resource name
    (a profile with two attributes, ``+me,gfx``, would hold a comma)."""
    name = "mig-" + profile.replace("+", ".")
    if not _RESOURCE_NAME_RE.match(name):
        raise ProfileError(f"MIG profile {profile[:40]!r} makes no valid resource name ({name!r})")
    return name
