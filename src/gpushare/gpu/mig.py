"""MIG strategies: which cards are sliced, which MIG devices are served under which name.

Pure policy over the :class:`~gpushare.gpu.gpus.Gpu` records; the daemon logs the plan's
skipped cards and serves its resources.

* ``none``: a card in MIG mode is left out (one line each), as before MIG support.
* ``single``: every MIG device of the node is one ``<prefix>/gpu`` device; refused when
  the node's MIG devices are not all of one profile.
* ``mixed``: one resource per profile, ``<prefix>/mig-<profile>`` with ``+`` as ``.``
  (``mig-3g.20gb``, ``mig-1g.10gb.me``); one device per MIG device.

In every strategy a card whose MIG mode is *pending* (it changes at the next reset) is
left out: sliced as a whole card it would vanish under its tenants at the reset.
Device IDs of MIG devices are their ``MIG-...`` UUIDs.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gpushare.gpu.gpus import Gpu, MigDevice
from gpushare.gpu.migprofile import ProfileError, resource_suffix

#: The resource name (after the prefix) of MIG devices in the ``single`` strategy.
SINGLE_RESOURCE = "gpu"
#: The prefix of NVIDIA's plugin, for ``--mig-nvidia-names``.
NVIDIA_PREFIX = "nvidia.com"


class MigStrategy(enum.Enum):
    NONE = "none"
    SINGLE = "single"
    MIXED = "mixed"


STRATEGIES = tuple(strategy.value for strategy in MigStrategy)


class MigPlanError(ValueError):
    """The node's MIG layout cannot be served with the chosen strategy (one line)."""


@dataclass(frozen=True)
class Skipped:
    gpu: Gpu
    reason: str


@dataclass(frozen=True)
class MigPlan:
    """What to serve: cards to slice, and MIG devices per resource name (no prefix)."""

    strategy: MigStrategy
    shared: tuple[Gpu, ...]
    exclusive: Mapping[str, tuple[MigDevice, ...]] = field(default_factory=dict)
    skipped: tuple[Skipped, ...] = ()
    mig_cards: tuple[Gpu, ...] = ()  # the cards whose MIG devices are served
    #: MIG devices sliced into memory units like cards (``migSharing``, experimental).
    shared_mig: tuple[MigDevice, ...] = ()

    def shared_gpus(self) -> list[Gpu]:
        """The cards to slice: whole cards, then each shared MIG device as a card."""
        return list(self.shared) + [as_card(self._parent(d), d) for d in self.shared_mig]

    def _parent(self, device: MigDevice) -> Gpu:
        return next(gpu for gpu in self.mig_cards if gpu.uuid == device.parent_uuid)

    def mig_of(self) -> dict[str, tuple[MigDevice, ...]]:
        """Card UUID -> its served MIG devices (what health maps a card's events to)."""
        served = {device.uuid for device in self.mig_devices + list(self.shared_mig)}
        return {
            gpu.uuid: tuple(d for d in gpu.mig_devices if d.uuid in served)
            for gpu in self.mig_cards
        }

    @property
    def mig_devices(self) -> list[MigDevice]:
        return [device for devices in self.exclusive.values() for device in devices]

    def not_served(self, gpus: Iterable[Gpu]) -> str:
        """Why nothing at all is served on a node with GPUs; "" when something is."""
        gpus = list(gpus)
        if not gpus or self.shared or self.mig_devices or self.shared_mig:
            return ""
        if all(gpu.mig_enabled or gpu.mig_pending for gpu in gpus):
            none = self.strategy is MigStrategy.NONE
            hint = "; use --mig-strategy mixed or single" if none else ""
            return (
                f"every GPU on this node ({len(gpus)}) is in MIG mode or changing to it, and "
                f"--mig-strategy {self.strategy.value} serves none of them{hint}"
            )
        return f"no GPU on this node can be served ({len(gpus)} found, all left out)"


def _profiles(devices: Iterable[MigDevice]) -> str:
    counts = Counter(device.profile for device in devices)
    return ", ".join(f"{profile} x{n}" for profile, n in sorted(counts.items()))


def as_card(parent: Gpu, device: MigDevice) -> Gpu:
    """A MIG device as a card to slice (``migSharing``): its UUID, its memory, the
    parent's minor and NUMA node; ``parent_uuid`` marks it (no core units)."""
    return Gpu(
        uuid=device.uuid,
        name=f"{parent.name} MIG {device.profile}",
        memory_mib=device.memory_mib,
        index=parent.index,
        minor=parent.minor,
        numa_node=parent.numa_node,
        pci_bus_id=parent.pci_bus_id,
        parent_uuid=parent.uuid,
    )


def plan(gpus: Iterable[Gpu], strategy: MigStrategy, *, sharing: bool = False) -> MigPlan:
    """Sort the node's cards by the strategy; :class:`MigPlanError` for ``single`` on
    a node whose MIG devices are not uniform. With ``sharing`` (``mixed`` only) the MIG
    devices are sliced into memory units like cards instead of served whole."""
    shared: list[Gpu] = []
    skipped: list[Skipped] = []
    mig_cards: list[Gpu] = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        if gpu.mig_pending:
            change = "disabled" if gpu.mig_enabled else "enabled"
            skipped.append(Skipped(gpu, f"MIG mode is pending (it is {change} at the next reset)"))
        elif not gpu.mig_enabled:
            shared.append(gpu)
        elif strategy is MigStrategy.NONE:
            skipped.append(Skipped(gpu, "MIG-enabled GPUs are not served with --mig-strategy none"))
        elif not gpu.mig_devices:
            skipped.append(Skipped(gpu, "MIG mode is on but the GPU holds no MIG device"))
        else:
            mig_cards.append(gpu)
    devices = [device for gpu in mig_cards for device in gpu.mig_devices]
    exclusive: dict[str, tuple[MigDevice, ...]] = {}
    if strategy is MigStrategy.SINGLE and devices:
        if len({device.profile for device in devices}) > 1:
            raise MigPlanError(
                "--mig-strategy single needs every MIG device on the node to have the same "
                f"profile, found {_profiles(devices)}; use --mig-strategy mixed or repartition"
            )
        exclusive[SINGLE_RESOURCE] = tuple(devices)
    elif strategy is MigStrategy.MIXED:
        by_name: dict[str, list[MigDevice]] = {}
        for gpu in mig_cards:
            for device in gpu.mig_devices:
                try:
                    name = resource_suffix(device.profile)
                except ProfileError as exc:
                    skipped.append(Skipped(gpu, f"MIG device {device.uuid} left out: {exc}"))
                    continue
                by_name.setdefault(name, []).append(device)
        exclusive = {name: tuple(found) for name, found in sorted(by_name.items())}
    shared_mig: tuple[MigDevice, ...] = ()
    if sharing and strategy is MigStrategy.MIXED:
        named = {d.uuid for devices in exclusive.values() for d in devices}
        shared_mig = tuple(d for g in mig_cards for d in g.mig_devices if d.uuid in named)
        exclusive = {}
    served = {d.parent_uuid for d in shared_mig} | {
        device.parent_uuid for devices in exclusive.values() for device in devices
    }
    cards = tuple(gpu for gpu in mig_cards if gpu.uuid in served)
    return MigPlan(strategy, tuple(shared), exclusive, tuple(skipped), cards, shared_mig)


_LABEL_SUFFIXES = (".count", ".memory", ".multiprocessors")


def is_label(prefix: str, key: str) -> bool:
    """Whether a node label key is one :func:`labels` writes (uninstall removes them)."""
    name = key.removeprefix(f"{prefix}/")
    if name == key:
        return False
    return name == "mig.strategy" or (name.startswith("mig-") and name.endswith(_LABEL_SUFFIXES))


def labels(plan: MigPlan, prefix: str) -> dict[str, str]:
    """Node labels in GPU feature discovery's style: ``<prefix>/mig.strategy`` and, per
    served profile, ``<prefix>/mig-<profile>.count``, ``.memory`` (MiB of one device)
    and ``.multiprocessors``. None with the strategy ``none`` (MIG support off)."""
    if plan.strategy is MigStrategy.NONE:
        return {}
    result = {f"{prefix}/mig.strategy": plan.strategy.value}
    by_profile: dict[str, list[MigDevice]] = {}
    for device in plan.mig_devices:
        by_profile.setdefault(device.profile, []).append(device)
    for profile, devices in sorted(by_profile.items()):
        try:
            base = f"{prefix}/{resource_suffix(profile)}"
        except ProfileError:
            continue
        count, memory, sms = _LABEL_SUFFIXES
        result[base + count] = str(len(devices))
        result[base + memory] = str(min(device.memory_mib for device in devices))
        result[base + sms] = str(min(device.sm_count for device in devices))
    return result


def health_keys(plan: MigPlan) -> list[str]:
    """The health board's keys for MIG: the cards and their served MIG devices."""
    return [gpu.uuid for gpu in plan.mig_cards] + [d.uuid for d in plan.mig_devices]


def resource_prefix(nvidia_names: bool, prefix: str) -> str:
    """The prefix MIG resources are named with: NVIDIA's with ``--mig-nvidia-names``."""
    return NVIDIA_PREFIX if nvidia_names else prefix
