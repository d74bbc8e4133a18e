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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from gpushare.devices import Resource

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
class Answer:
    """One ContainerAllocateResponse, as plain data."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Enforcement:
    """How limits reach the interposer; ``library`` is None when running without it."""

    library: Path | None  # the versioned host file, e.g. /usr/local/vgpu/libvgpu.so.1a2b3c4d5e6f
    preload_file: Path | None  # host file listing CONTAINER_LIBRARY, for /etc/ld.so.preload
    use_ld_preload_env: bool
    # host directory mounted at LOCK_DIR (library.ensure_lock_dir); None: the host's LOCK_DIR
    lock_dir: Path | None = None


def build_answer(
    resource: Resource,
    uuid: str,
    units: int,
    *,
    memory_unit_mib: int,
    enforcement: Enforcement,
    cache_dir: Path | None = None,
) -> Answer:
    """The answer binding a container to card ``uuid`` with ``units`` of ``resource``."""
    envs = {"NVIDIA_VISIBLE_DEVICES": uuid}
    mounts: list[Mount] = []
    annotations: dict[str, str] = {}
    if resource is Resource.MEMORY:
        envs["CUDA_DEVICE_MEMORY_LIMIT_0"] = f"{units * memory_unit_mib}m"
    else:
        envs["CUDA_DEVICE_SM_LIMIT"] = str(units)

    if enforcement.library is None:
        annotations[ANNOTATION_NO_ENFORCEMENT] = (
            "disabled: gpushare runs with --no-enforcement, limits are advisory"
        )
        return Answer(envs, mounts, annotations)

    mounts.append(Mount(CONTAINER_LIBRARY, str(enforcement.library), read_only=True))
    mounts.append(Mount(LOCK_DIR, str(enforcement.lock_dir or LOCK_DIR), read_only=False))
    if enforcement.use_ld_preload_env:
        envs["LD_PRELOAD"] = CONTAINER_LIBRARY
    if enforcement.preload_file is not None:
        mounts.append(Mount(LD_SO_PRELOAD, str(enforcement.preload_file), read_only=True))
    if resource is Resource.MEMORY and cache_dir is not None:
        envs["CUDA_DEVICE_MEMORY_SHARED_CACHE"] = CONTAINER_CACHE_FILE
        mounts.append(Mount(CONTAINER_CACHE_DIR, str(cache_dir), read_only=False))
    return Answer(envs, mounts, annotations)
