"""What a container is told: the envs and mounts of an Allocate answer. Pure.

A container that asks for both resources gets two answers, one per resource, which
the kubelet merges (the first value of a key wins, a differing second value is only
logged). So each answer sets only what belongs to its resource, and anything both
answers set is identical:

* both: ``NVIDIA_VISIBLE_DEVICES`` (the same card, by construction), ``LD_PRELOAD``,
  the library mount and the lock directory mount;
* memory only: ``CUDA_DEVICE_MEMORY_LIMIT_0``, the per-container cache directory and
  ``CUDA_DEVICE_MEMORY_SHARED_CACHE``;
* core only: ``CUDA_DEVICE_SM_LIMIT``.

A variable that is not set means "no limit" to libvgpu: memory without core runs
unthrottled, core without memory may use the whole card's memory.

:func:`enforcement_answer` is the one port every front door calls: a :class:`Grant`
(this card, these limits) in, the answer out. A DRA claim grants both limits at once
and gets in one answer what the kubelet merges from the device plugin's two.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpushare.share.devices import Resource

CONTAINER_LIBRARY = "/usr/local/vgpu/libvgpu.so"
CONTAINER_CACHE_DIR = "/usr/local/vgpu/cache"
CONTAINER_CACHE_FILE = f"{CONTAINER_CACHE_DIR}/vgpu.cache"
LOCK_DIR = "/tmp/vgpulock"
LD_SO_PRELOAD = "/etc/ld.so.preload"

ANNOTATION_NO_ENFORCEMENT = "gpushare.io/enforcement"


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True)
class DeviceSpec:
    """A device node for the container (``ContainerAllocateResponse.devices``)."""

    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class Answer:
    """One ContainerAllocateResponse, as plain data."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)  # fully qualified CDI names
    device_specs: list[DeviceSpec] = field(default_factory=list)


@dataclass(frozen=True)
class Enforcement:
    """How limits reach the interposer; ``library`` is None when running without it."""

    library: Path | None  # the versioned host file, e.g. /usr/local/vgpu/libvgpu.so.1a2b3c4d5e6f
    preload_file: Path | None  # host file listing CONTAINER_LIBRARY, for /etc/ld.so.preload
    use_ld_preload_env: bool
    # host directory mounted at LOCK_DIR (library.ensure_lock_dir); None: the host's LOCK_DIR
    lock_dir: Path | None = None


def lock_mount(enforcement: Enforcement) -> Mount:
    """HAMi-core's lock directory, shared by every container with the interposer."""
    return Mount(LOCK_DIR, str(enforcement.lock_dir or LOCK_DIR), read_only=False)


@dataclass(frozen=True)
class Grant:
    """What one container (or one claim) gets of one card: the enforcement port's input.

    ``memory_mib`` and ``cores`` are the limits to enforce; ``None`` leaves that limit
    out of this answer (a device-plugin Allocate carries one resource at a time, the
    kubelet merges the two answers; a DRA claim carries both at once)."""

    uuid: str
    memory_mib: int | None = None
    cores: int | None = None


def enforcement_answer(
    grant: Grant,
    *,
    enforcement: Enforcement,
    cache_dir: Path | None = None,
    listing: DeviceListing | None = None,
    cdi_id: str | None = None,
) -> Answer:
    """The one port from "this container gets these limits on this card" to what the
    runtime applies: HAMi-core's environment (``CUDA_DEVICE_MEMORY_LIMIT_0``,
    ``CUDA_DEVICE_SM_LIMIT``), the interposer and its preload, the lock directory, the
    container's cache directory (``cache_dir``, with a memory limit) and, with
    ``listing``, the card named as the device-list strategy says (``cdi_id``: its CDI
    device part where that is not the UUID). Pure; every front door calls it."""
    envs = {"NVIDIA_VISIBLE_DEVICES": grant.uuid}
    mounts: list[Mount] = []
    annotations: dict[str, str] = {}
    if grant.memory_mib is not None:
        envs["CUDA_DEVICE_MEMORY_LIMIT_0"] = f"{grant.memory_mib}m"
    if grant.cores is not None:
        envs["CUDA_DEVICE_SM_LIMIT"] = str(grant.cores)
    if enforcement.library is None:
        annotations[ANNOTATION_NO_ENFORCEMENT] = (
            "disabled: gpushare runs with --no-enforcement, limits are advisory"
        )
    else:
        mounts.append(Mount(CONTAINER_LIBRARY, str(enforcement.library), read_only=True))
        mounts.append(lock_mount(enforcement))
        if enforcement.use_ld_preload_env:
            envs["LD_PRELOAD"] = CONTAINER_LIBRARY
        if enforcement.preload_file is not None:
            mounts.append(Mount(LD_SO_PRELOAD, str(enforcement.preload_file), read_only=True))
        if grant.memory_mib is not None and cache_dir is not None:
            envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = CONTAINER_CACHE_FILE
            mounts.append(Mount(CONTAINER_CACHE_DIR, str(cache_dir), read_only=False))
    answer = Answer(envs, mounts, annotations)
    if listing is None:
        return answer
    return with_device_list(answer, [grant.uuid], listing, [cdi_id] if cdi_id else None)


def build_answer(
    resource: Resource,
    uuid: str,
    units: int,
    *,
    memory_unit_mib: int,
    enforcement: Enforcement,
    cache_dir: Path | None = None,
) -> Answer:
    """A device-plugin Allocate's answer: ``units`` of one ``resource`` on card ``uuid``."""
    if resource is Resource.MEMORY:
        grant = Grant(uuid, memory_mib=units * memory_unit_mib)
    else:
        grant = Grant(uuid, cores=units)
    return enforcement_answer(grant, enforcement=enforcement, cache_dir=cache_dir)


# --------------------------------------------------------------------------- exclusive


def build_exclusive_answer(
    device_ids: Sequence[str],
    *,
    enforcement: Enforcement | None = None,
    memory_mib: Sequence[int] = (),
) -> Answer:
    """The answer handing a container whole devices (cards or MIG instances).

    ``device_ids`` are in the order the container sees them (index ``i`` below).
    Without ``enforcement`` the container gets the raw devices: no interposer, no
    limits. With it (``exclusiveEnforcement``) the library is loaded as for shared
    units with 100 % limits: ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` = the whole memory of
    device ``i`` (``memory_mib[i]``), ``CUDA_DEVICE_SM_LIMIT=100``, so a site keeps
    the same accounting everywhere.
    """
    envs = {"NVIDIA_VISIBLE_DEVICES": ",".join(device_ids)}
    if enforcement is None or enforcement.library is None:
        return Answer(envs)
    mounts = [
        Mount(CONTAINER_LIBRARY, str(enforcement.library), read_only=True),
        lock_mount(enforcement),
    ]
    if enforcement.use_ld_preload_env:
        envs["LD_PRELOAD"] = CONTAINER_LIBRARY
    if enforcement.preload_file is not None:
        mounts.append(Mount(LD_SO_PRELOAD, str(enforcement.preload_file), read_only=True))
    for i, mib in enumerate(memory_mib):
        envs[f"CUDA_DEVICE_MEMORY_LIMIT_{i}"] = f"{mib}m"
    envs["CUDA_DEVICE_SM_LIMIT"] = "100"
    return Answer(envs, mounts)


# --------------------------------------------------------------------------- device lists

ENVVAR = "envvar"
CDI_CRI = "cdi-cri"
CDI_ANNOTATIONS = "cdi-annotations"
DEVICE_LIST_STRATEGIES = (ENVVAR, CDI_CRI, CDI_ANNOTATIONS)
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
#: What the NVIDIA container toolkit reads as "no GPU": set when the envvar strategy is
#: off, so an image's own ``NVIDIA_VISIBLE_DEVICES=all`` cannot expose every card.
NO_DEVICES = "void"


@dataclass(frozen=True)
class DeviceListing:
    """How an answer names its devices to the container runtime (``--device-list-strategy``).

    ``strategies`` is a subset of :data:`DEVICE_LIST_STRATEGIES`, combinable:
    ``envvar`` sets ``NVIDIA_VISIBLE_DEVICES`` (the NVIDIA runtime reads it),
    ``cdi-cri`` fills ``ContainerAllocateResponse.cdi_devices`` (kubelet >= 1.31),
    ``cdi-annotations`` adds ``cdi.k8s.io/<plugin>_<first id>: <names>``.
    """

    strategies: frozenset[str] = frozenset({ENVVAR})
    cdi_kind: str = "nvidia.com/gpu"  # <vendor>/<class> of the CDI names
    annotation_plugin: str = "gpushare"  # the <plugin> part of the annotation key
    #: device ID -> its CDI device name where that differs (the "index" name strategy)
    cdi_ids: Mapping[str, str] = field(default_factory=dict)

    @property
    def uses_cdi(self) -> bool:
        return bool(self.strategies & {CDI_CRI, CDI_ANNOTATIONS})

    def cdi_name(self, device: str) -> str:
        """``nvidia.com/gpu=GPU-...``: a fully qualified CDI device name."""
        return f"{self.cdi_kind}={self.cdi_ids.get(device, device)}"

    def annotation_key(self, first_device: str) -> str:
        """``cdi.k8s.io/<plugin>_<device>``, '/' replaced by '_', name part <= 63 chars."""
        name = f"{self.annotation_plugin}_{first_device.replace('/', '_')}"
        return CDI_ANNOTATION_PREFIX + name[:63].rstrip("-_.")


def with_device_list(
    answer: Answer,
    devices: Sequence[str],
    listing: DeviceListing,
    cdi_devices: Sequence[str] | None = None,
) -> Answer:
    """``answer`` naming ``devices`` as ``listing`` says. Pure.

    ``cdi_devices`` are the CDI device parts to use (default: ``devices``; the
    ``index`` name strategy passes card indexes instead of UUIDs). Everything else of
    the answer (limits, interposer mounts) stays as it is.
    """
    envs = dict(answer.envs)
    annotations = dict(answer.annotations)
    names = [listing.cdi_name(d) for d in (devices if cdi_devices is None else cdi_devices)]
    if ENVVAR in listing.strategies:
        envs["NVIDIA_VISIBLE_DEVICES"] = ",".join(devices)
    else:
        envs["NVIDIA_VISIBLE_DEVICES"] = NO_DEVICES
    cdi = names if CDI_CRI in listing.strategies else []
    if CDI_ANNOTATIONS in listing.strategies and devices:
        annotations[listing.annotation_key(devices[0])] = ",".join(names)
    return replace(answer, envs=envs, annotations=annotations, cdi_devices=cdi)
