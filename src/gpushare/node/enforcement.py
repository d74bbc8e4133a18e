"""From the settings to what every answer carries: the interposer installed on the host,
the preload file, the lock directory, and how answers name their cards."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import structlog

from gpushare.base.startup import BadLibrary, StartupError
from gpushare.config import Settings
from gpushare.gpu.gpus import Gpu
from gpushare.host.elf import NotASharedObject, check_shared_object
from gpushare.host.library import (
    LibraryError,
    ensure_cache_root,
    ensure_lock_dir,
    install_library,
    install_preload_file,
)
from gpushare.share.answers import DeviceListing, Enforcement

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


def device_listing(settings: Settings, gpus: Sequence[Gpu]) -> DeviceListing:
    """How answers name their cards (``--device-list-strategy`` and the CDI settings)."""
    by_index = settings.cdi_name_strategy == "index"
    return DeviceListing(
        strategies=settings.device_list_strategies(),
        cdi_kind=settings.cdi_kind,
        cdi_ids={g.uuid: str(g.index) for g in gpus} if by_index else {},
    )
