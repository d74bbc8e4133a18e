"""Each card's enforcement backend, decided at start (:mod:`gpushare.share.backendchoice`) from
what this node really offers: the driver's version, the cgroup file system, MIG, CDI, and
for ``driver`` a self-test on a scratch cgroup of the daemon's own (set a limit, read it
back, clear it: a read on a cgroup without a limit proves nothing). One
``enforcement_backend`` event per card says what was chosen and why; a pinned backend the
node cannot give stops the start with one line naming the reason.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

from gpushare.base.startup import NodeConfigurationError
from gpushare.config import Settings
from gpushare.gpu.gpus import Gpu
from gpushare.gpu.memlimits import (
    READBACK_UNSUPPORTED,
    UNLIMITED,
    MemoryLimitDriver,
    MemoryLimitError,
)
from gpushare.host.mps import available as mps_available
from gpushare.kube.nodestate import MAX_REASON, CardEnforcement
from gpushare.node.podcgroups import dmem_obstacle, pod_cgroups
from gpushare.share.backendchoice import (
    COMPUTE_PINS,
    MEMORY_PINS,
    CardTraits,
    Choice,
    NodeFacts,
    PinRefused,
    check_pin_keys,
    choose,
    parse_pins,
    wants_driver_probe,
)
from gpushare.share.cardmodes import CardMode

log = structlog.get_logger(__name__)

#: Whether the device plugin's answers can carry the memory hook: they do under a CDI
#: device-list strategy, where each grant's edits go into a CDI spec of its own
#: (``host/grantspecs.py``; the kubelet's Allocate API has no field for hooks). Without
#: CDI a device-plugin card is never ``driver`` (its reason: no CDI); DRA claims always
#: have their own spec.
DEVICE_PLUGIN_HOOKS = True
#: The limit the self-test sets (and reads back) on its scratch cgroup.
PROBE_BYTES = 64 << 20
#: The v1 controllers' directories, one of which a cgroup v1 root holds.
V1_CONTROLLERS = ("memory", "cpu", "cpu,cpuacct", "devices", "pids")


def cgroup_type(root: Path) -> str:
    """``v2`` when ``root`` is a cgroup v2 mount (its ``cgroup.controllers`` file), ``v1``
    when it holds v1 controller directories, else ``none``."""
    if (root / "cgroup.controllers").is_file():
        return "v2"
    if any((root / name).is_dir() for name in V1_CONTROLLERS):
        return "v1"
    return "none"


def self_test(driver: MemoryLimitDriver, uuid: str, where: Path) -> str:
    """Set, read back and clear a limit on a scratch cgroup under ``where`` for card
    ``uuid``; "" when every step held, else why not (one line). The scratch cgroup is
    removed whatever happened (removing a cgroup clears its limit). ``where`` is beside
    the kubelet's pods (:func:`driver_test`), not the cgroup root."""
    scratch = where / f"gpushare-selftest-{os.getpid()}"
    try:
        scratch.mkdir(mode=0o755)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot make the scratch cgroup {scratch}: {exc.strerror}"
    try:
        driver.set_memory_limits(uuid, str(scratch), 0, PROBE_BYTES)
        got = driver.get_memory_limits(uuid, str(scratch))
        if got is None:
            return (
                f"set hard {PROBE_BYTES} on a scratch cgroup, read back nothing "
                f"(NOT_SUPPORTED): {READBACK_UNSUPPORTED}"
            )
        if (got.soft, got.hard) != (0, PROBE_BYTES):
            seen = f"soft {got.soft} hard {got.hard}"
            return f"set hard {PROBE_BYTES} on a scratch cgroup, read back {seen}"
        driver.set_memory_limits(uuid, str(scratch), 0, UNLIMITED)
        cleared = driver.get_memory_limits(uuid, str(scratch))
        if cleared is not None and cleared.hard != UNLIMITED:
            return f"a cleared limit still reads hard {cleared.hard}"
        return ""
    except (MemoryLimitError, OSError) as exc:
        return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    finally:
        with contextlib.suppress(OSError):
            scratch.rmdir()


def driver_test(driver: MemoryLimitDriver, card: CardTraits, root: Path) -> str:
    """The ``driver`` test of one card where containers live: on the ``dmem`` backend the
    kubelet's cgroup levels must carry ``+dmem`` down to the pods
    (:mod:`gpushare.node.podcgroups`), then the self-test runs on a scratch cgroup beside
    the pods. "" when it holds, else why not (one line)."""
    memacct, obstacle = dmem_obstacle(root, card.pci_bus_id)
    where = pod_cgroups(root).scratch_parent(root)
    result = obstacle or self_test(driver, card.uuid, where)
    log.info(
        "driver_memacct",
        card=card.uuid,
        backend=memacct,
        tested_at=str(where),
        passed=not result,
    )
    return result


def card_traits(
    gpus: Sequence[Gpu],
    mig_cards: Sequence[Gpu],
    modes: Mapping[str, CardMode],
    uses_cdi: bool,
) -> list[CardTraits]:
    """The decision's view of every card: ``gpus`` (cards and ``migSharing`` slices) and
    the cards in MIG mode; a card in mode ``dra`` always has CDI (its claims' specs)."""
    traits = []
    for gpu in gpus:
        mode = modes.get(gpu.uuid, CardMode.BOTH)
        traits.append(
            CardTraits(
                gpu.uuid,
                gpu.index,
                mig=gpu.mig_enabled and not gpu.parent_uuid,
                mig_slice=bool(gpu.parent_uuid),
                whole_only=mode is CardMode.EXCLUSIVE,
                cdi=uses_cdi or mode is CardMode.DRA,
                timeslice=mode is CardMode.TIMESLICE,
                pci_bus_id=gpu.pci_bus_id,
            )
        )
    traits += [CardTraits(g.uuid, g.index, mig=True) for g in mig_cards]
    return traits


def decide_backends(
    settings: Settings,
    driver: object,
    traits: Sequence[CardTraits],
) -> dict[str, Choice]:
    """Every card's backends (by UUID), self-testing ``driver`` where it could be
    chosen; :class:`NodeConfigurationError` for a pin the node cannot give. ``driver``
    is the GPU backend (it may not have the memory-limit calls at all)."""
    try:
        memory = parse_pins(settings.memory_enforcement, MEMORY_PINS, "memoryEnforcement")
        compute = parse_pins(settings.compute_enforcement, COMPUTE_PINS, "computeEnforcement")
        named = [(t.uuid, t.index) for t in traits if not t.mig_slice]
        check_pin_keys(memory, named, "memoryEnforcement")
        check_pin_keys(compute, named, "computeEnforcement")
    except ValueError as exc:
        raise NodeConfigurationError(str(exc)) from None
    limits = driver if _has_limits(driver) else None
    version = limits.driver_version() if limits is not None else None  # type: ignore[attr-defined]
    node = NodeFacts(
        driver_version=version,
        cgroup=cgroup_type(Path(settings.cgroup_root)),
        interposer=not settings.no_enforcement,
        mps=mps_available(settings.mps_control) is None,
    )
    if settings.mps_control and not node.mps:
        log.warning("mps_unavailable", reason=mps_available(settings.mps_control))
    choices: dict[str, Choice] = {}
    for card in traits:
        memory_pin = memory.for_card(card.uuid, card.index)
        if wants_driver_probe(node, card, memory_pin):
            result = (
                driver_test(limits, card, Path(settings.cgroup_root))  # type: ignore[arg-type]
                if limits is not None
                else "the GPU backend cannot set memory limits"
            )
            card = CardTraits(**{**card.__dict__, "probe": result})
            if result:
                log.warning("driver_selftest_failed", card=card.uuid, reason=result)
        try:
            choice = choose(node, card, memory_pin, compute.for_card(card.uuid, card.index))
        except PinRefused as exc:
            raise NodeConfigurationError(str(exc)) from None
        choices[card.uuid] = choice
    for choice in choices.values():
        log.info(
            "enforcement_backend",
            card=choice.uuid,
            index=choice.index,
            memory=choice.memory.value,
            memory_reason=choice.memory_reason,
            compute=choice.compute.value,
            compute_reason=choice.compute_reason,
            driver_version=node.driver_version,
            cgroup=node.cgroup,
        )
    return choices


def _has_limits(driver: object) -> bool:
    return all(
        callable(getattr(driver, name, None))
        for name in ("driver_version", "set_memory_limits", "get_memory_limits")
    )


def shown_enforcement(choices: Mapping[str, Choice]) -> tuple[CardEnforcement, ...]:
    """The choices as the Node annotation, the labels, inspect and the metrics show
    them (``migSharing`` slices are shown by the MIG devices' own entries: left out)."""
    return tuple(
        CardEnforcement(
            c.uuid, c.index, c.memory.value, c.compute.value, c.memory_reason[:MAX_REASON]
        )
        for c in sorted(choices.values(), key=lambda c: (c.index, c.uuid))
        if not c.uuid.startswith("MIG-")
    )
