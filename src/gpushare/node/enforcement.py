"""From the settings to what every answer carries: the interposer installed on the host,
the preload file, the lock directory, and how answers name their cards."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import structlog

from gpushare.base.startup import BadLibrary, StartupError
from gpushare.config import Settings
from gpushare.gpu.gpus import Gpu
from gpushare.gpu.mig import MigPlan
from gpushare.host.elf import NotASharedObject, check_shared_object
from gpushare.host.library import (
    LibraryError,
    ensure_cache_root,
    ensure_lock_dir,
    install_hook,
    install_library,
    install_preload_file,
)
from gpushare.host.mps import mps_dirs, mps_shm_dir
from gpushare.share.answers import DeviceListing, DriverHook, Enforcement
from gpushare.share.backendchoice import Choice, ComputeBackend, MemoryBackend

log = structlog.get_logger(__name__)


def check_library(path: Path) -> None:
    """Refuse an interposer that is not an ELF shared object of this node's machine; a
    missing file is left to the installer's own message."""
    try:
        check_shared_object(path)
    except OSError:
        return
    except NotASharedObject as exc:
        raise BadLibrary(
            f"--library {path} is {exc}: it would be preloaded and silently ignored, and "
            "no limit enforced; point --library at HAMi-core's libvgpu.so for this "
            "architecture, or run with --no-enforcement"
        ) from None


def prepare_enforcement(settings: Settings) -> Enforcement:
    """Install the interposer (and the preload file) on the host and make the cache root
    and the lock directory; ``--no-enforcement`` gives limits as env only."""
    if settings.no_enforcement:
        log.warning(
            "enforcement_disabled",
            detail="--no-enforcement: containers get limits as env only, nothing enforces them",
        )
        return Enforcement(library=None, preload_file=None, use_ld_preload_env=False)
    check_library(Path(settings.library))
    try:
        library = install_library(Path(settings.library), Path(settings.host_lib_dir))
        preload_file = (
            install_preload_file(library) if settings.preload in ("file", "both") else None
        )
        ensure_cache_root(Path(settings.host_lib_dir))
    except (LibraryError, OSError) as exc:
        raise StartupError(str(exc)) from None
    lock_dir = ensure_lock_dir(Path(settings.host_lib_dir))  # never fails start
    log.info("library_installed", path=str(library), preload=settings.preload)
    return Enforcement(
        library=library,
        preload_file=preload_file,
        use_ld_preload_env=settings.preload in ("env", "both"),
        lock_dir=lock_dir,
    )


def with_backends(
    enforcement: Enforcement,
    settings: Settings,
    choices: Mapping[str, Choice],
    gpus: object,
    serves_dra: bool = False,
    totals: Mapping[str, int] | None = None,
) -> Enforcement:
    """``enforcement`` with each card's backends (:mod:`gpushare.node.backendfacts`) and, where
    a card's memory is the driver's, the memory hook installed on the host. ``gpus``: the
    GPU backend (a simulated one adds the stand-in NVML to the hook's arguments). Where the
    DRA driver serves a card (``serves_dra``) and the interposer is on, the same program is
    installed as the claims' limit check (:func:`install_limit_check`). ``totals``: each
    card's total memory (MiB), the most a driver hook's limit may say."""
    memory = {
        uuid: c.memory.value
        for uuid, c in choices.items()
        if c.memory is not MemoryBackend.INTERPOSER
    }
    compute = {
        uuid: c.compute.value
        for uuid, c in choices.items()
        if c.compute is not ComputeBackend.INTERPOSER
    }
    hook = None
    if MemoryBackend.DRIVER.value in memory.values():
        hook = install_driver_hook(settings, gpus)
    check = None
    if serves_dra and enforcement.library is not None:
        check = hook.path if hook is not None else install_limit_check(settings)
    mps_pipe = mps_shm = None
    if ComputeBackend.MPS.value in compute.values():  # without namespaces: its own pipes
        mps_pipe, _logs = mps_dirs(Path(settings.host_lib_dir))
        mps_shm = mps_shm_dir(Path(settings.host_lib_dir))
    return replace(
        enforcement,
        memory=memory,
        compute=compute,
        driver_hook=hook,
        card_memory_mib=dict(totals or {}),
        limit_check=check,
        mps_pipe=mps_pipe,
        mps_shm=mps_shm,
    )


def install_driver_hook(settings: Settings, gpus: object) -> DriverHook:
    """Install the hook program beside the interposer; on a simulated node its calls name
    the stand-in NVML and the stand-in cgroup root (``hook_extras`` of the backend)."""
    try:
        path = install_hook(Path(settings.memory_hook), Path(settings.host_lib_dir))
    except LibraryError as exc:
        raise StartupError(str(exc)) from None
    log.info("memory_hook_installed", path=str(path))
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    extras = getattr(gpus, "hook_extras", None)
    if settings.simulate and extras is not None:
        more_args, env = extras()
        args = (*more_args, "--cgroup-root", settings.cgroup_root)
    return DriverHook(str(path), args, env)


def install_limit_check(settings: Settings) -> str | None:
    """Install the memory hook for its ``--check-limits`` mode, which every DRA claim share
    the interposer holds names in its CDI spec (issue 32 item 2). Where it cannot be
    installed the daemon still starts (the device plugin and the other DRA devices work),
    logs ``limit_check_unavailable`` and refuses those shares at prepare with the reason:
    fail closed, as a missing check would let a container of two claims of unequal shares
    run the smaller one's card above its charge."""
    try:
        path = install_hook(Path(settings.memory_hook), Path(settings.host_lib_dir))
    except LibraryError as exc:
        log.error(
            "limit_check_unavailable",
            error=str(exc),
            detail="DRA claim shares whose limits the interposer holds are refused until "
            "--memory-hook names the hook program (the image's "
            "/opt/gpushare/lib/gpushare-memory-hook)",
        )
        return None
    log.info("limit_check_installed", path=str(path))
    return str(path)


def device_listing(
    settings: Settings,
    gpus: Sequence[Gpu],
    plan: MigPlan | None = None,
    dra_mig_cards: Sequence[Gpu] = (),
) -> DeviceListing:
    """How answers name their cards and MIG devices (``--device-list-strategy`` and the
    CDI settings); every front door answers with the same listing. ``dra_mig_cards``:
    the cards in MIG mode the DRA driver serves, outside ``plan``."""
    by_index = settings.cdi_name_strategy == "index"
    listing = DeviceListing(
        strategies=settings.device_list_strategies(),
        cdi_kind=settings.cdi_kind,
        cdi_ids={g.uuid: str(g.index) for g in [*gpus, *dra_mig_cards]} if by_index else {},
    )
    if plan is None:
        return listing
    return with_mig_names(listing, plan, by_index, dra_mig_cards)


def with_mig_names(
    listing: DeviceListing, plan: MigPlan, by_index: bool, dra_mig_cards: Sequence[Gpu] = ()
) -> DeviceListing:
    """``listing`` naming MIG devices as NVIDIA's CDI specs do under the ``index`` name
    strategy, ``<card index>:<MIG index>`` (sliced ones, and those of ``dra_mig_cards``,
    too); unchanged by UUID."""
    if not by_index:
        return listing
    cards = {gpu.uuid: gpu for gpu in [*plan.mig_cards, *dra_mig_cards]}
    devices = [*plan.mig_devices, *plan.shared_mig]
    devices += [d for card in dra_mig_cards for d in card.mig_devices]
    names = {d.uuid: f"{cards[d.parent_uuid].index}:{d.index}" for d in devices}
    return replace(listing, cdi_ids={**listing.cdi_ids, **names})
