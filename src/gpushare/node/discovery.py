"""Finding the node's GPUs at start: NVML (or the simulated node), retried while it fails.

A driver still loading or a card not yet ready is retried with growing delays (each
failure logged) until it works or the daemon is stopped: a crash loop would help
nothing, so /healthz stays alive meanwhile. With ``--fail-on-init-error`` the first
failure ends the start instead. A simulated node file with a mistake in it is fatal at
once (waiting will not fix a file someone wrote).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from gpushare.base.startup import NodeConfigurationError, StartupError
from gpushare.config import Settings
from gpushare.gpu import mig
from gpushare.gpu.gpus import Gpu, GpuBackend, GpuError
from gpushare.gpu.mig import MigPlan, MigPlanError, MigStrategy
from gpushare.gpu.simulated import SimulatedBackend
from gpushare.share.cardmodes import CardMode, parse_card_modes

log = structlog.get_logger(__name__)

#: Delays between attempts to initialise NVML and list the GPUs at start: first, longest.
DISCOVERY_RETRY_SECONDS = (0.5, 30.0)


def open_backend(simulate: str) -> GpuBackend:
    """The simulated backend when a node file is given, else NVML (the one place that
    chooses: :mod:`gpushare.gpu` has the two backends, neither knows the other)."""
    if simulate:
        return SimulatedBackend(Path(simulate))
    from gpushare.gpu.nvml import NvmlBackend  # pynvml: only on a real node

    return NvmlBackend()


@dataclass(frozen=True)
class Discovered:
    """What start-up found: the backend, the cards gpushare may slice, the MIG plan."""

    backend: GpuBackend
    gpus: list[Gpu]  # cards (and, with migSharing, MIG devices) that can be shared
    mig_plan: MigPlan  # what the device plugin serves of the cards in MIG mode
    not_served: str  # why nothing at all is served on this node ("" when something is)
    #: cards in MIG mode that card mode ``dra`` gives to the DRA driver (with their MIG
    #: devices): in no device-plugin plan, published by the DRA driver as MIG devices
    dra_mig_cards: list[Gpu] = field(default_factory=list)


def dra_mig_cards(gpus: Sequence[Gpu], card_modes_text: str) -> list[Gpu]:
    """The cards in MIG mode (not pending a change) that ``cardModes`` puts in ``dra``
    mode. A value that does not parse names none here: the core refuses it in one line."""
    try:
        spec = parse_card_modes(card_modes_text)
    except ValueError:
        return []
    return [
        g
        for g in gpus
        if g.mig_enabled
        and not g.mig_pending
        and spec.get(g.uuid, spec.get(str(g.index))) is CardMode.DRA
    ]


def plan_gpus(gpus: Sequence[Gpu], strategy: str, sharing: bool = False) -> MigPlan:
    """The cards gpushare slices and the MIG devices it serves (see mig.py); each card
    left out gets one log line. :class:`NodeConfigurationError` where the strategy
    cannot serve this node (``single`` on MIG devices of several profiles)."""
    try:
        result = mig.plan(gpus, MigStrategy(strategy), sharing=sharing)
    except MigPlanError as exc:
        raise NodeConfigurationError(str(exc)) from None
    for skipped in result.skipped:
        log.warning(
            "gpu_skipped",
            gpu=skipped.gpu.uuid,
            index=skipped.gpu.index,
            name=skipped.gpu.name,
            reason=skipped.reason,
        )
    return result


def report_persistence(gpus: Sequence[Gpu]) -> None:
    """One ``persistence_mode`` event per card (issue 41 item 6). Without persistence mode
    the driver sets a card up on the first open and tears it down after the last close; a
    memory hook opening NVML per container then pays about 2 s each (google/gvisor#9215)
    unless another process holds the driver open. On a real node the daemon does (its
    NVML handle stays open while it runs), so the hook pays it only while the daemon is
    down or restarting; ``nvidia-persistenced`` (persistence mode) closes that gap too."""
    for gpu in gpus:
        if gpu.parent_uuid:
            continue  # a MIG device sliced like a card: its card is reported
        mode = {True: "on", False: "off", None: "unknown"}[gpu.persistence_mode]
        log.info(
            "persistence_mode",
            card=gpu.uuid,
            index=gpu.index,
            mode=mode,
            detail=(
                "the driver stays initialised only while a process holds it open: the "
                "daemon's NVML handle does while it runs; a memory hook started while the "
                "daemon is down pays the driver's set-up (about 2 s); nvidia-persistenced "
                "avoids it"
            )
            if mode == "off"
            else "",
        )


class Discovery:
    """One start-up's search for the GPUs; :attr:`waiting_for` says why it is waiting."""

    def __init__(
        self, settings: Settings, stopping: threading.Event, backend: GpuBackend | None = None
    ) -> None:
        self.settings = settings
        self.stopping = stopping
        self.backend = backend
        self.waiting_for = ""  # why the GPUs could not be read, while starting

    def run(self) -> Discovered:
        """The GPUs, once readable; :class:`StartupError` when stopped meanwhile or when
        retrying cannot help."""
        settings = self.settings
        if self.backend is None and settings.simulate:
            try:
                self.backend = open_backend(settings.simulate)
            except GpuError as exc:
                raise StartupError(str(exc)) from None
        delay, longest = DISCOVERY_RETRY_SECONDS
        attempt = 0
        while True:
            try:
                if self.backend is None:
                    self.backend = open_backend(settings.simulate)
                found = self.backend.discover()
                dra = dra_mig_cards(found, settings.card_modes)
                planned = [g for g in found if g.uuid not in {d.uuid for d in dra}]
                plan = plan_gpus(planned, settings.mig_strategy, settings.mig_sharing)
                not_served = "" if dra else plan.not_served(planned)
                report_persistence(found)
                return Discovered(self.backend, plan.shared_gpus(), plan, not_served, dra)
            except GpuError as exc:
                if settings.fail_on_init_error:
                    raise StartupError(str(exc)) from None
                attempt += 1
                self.waiting_for = f"attempt {attempt} failed, next in {delay:g} s: {exc}"
                log.error(
                    "gpu_discovery_failed", error=str(exc), attempt=attempt, retry_seconds=delay
                )
            if self.stopping.wait(delay):
                raise StartupError("stopped while waiting for the GPUs to become readable")
            delay = min(delay * 2, longest)

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()
