"""The memory unit size must not change under running containers.

A memory device ID is ``<uuid>::<n>``: the kubelet's records say *which* units a
container holds, not how many MiB each was worth when it was allocated. A daemon
restarted with another ``--memory-unit-mib`` would read 2 units of 1024 MiB as 2 units
of 256 MiB and hand the 1536 MiB difference to the next container: two limits adding
up to more than the card.

So the unit size in effect is written on the node (``<host-lib-dir>/memory-unit.json``)
and checked at start against the kubelet's records, before anything registers:

* same size, or nobody holds memory units: the configured size is taken (and written);
* another size and some container holds memory units: the daemon refuses to start,
  naming the containers (exit 2, the line an operator reads);
* no record yet (first start, or a daemon from before this check): a unit number past
  the end of a card under the configured size proves the size changed; otherwise the
  configured size is taken;
* the records cannot be read: a recorded size that differs is refused (nothing can be
  confirmed), anything else starts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import structlog

from gpushare.base.atomicfile import replace_file
from gpushare.share.devices import SEPARATOR, Resource
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder

log = structlog.get_logger(__name__)

STATE_FILE = "memory-unit.json"
#: At most this many containers are named in the refusal.
NAMED_LIMIT = 5


class UnitSizeChanged(Exception):
    """The configured unit size would double-book running containers' memory."""


def memory_holders(snapshot: Snapshot) -> list[Holder]:
    """The containers the kubelet reports holding memory units, in a stable order."""
    return sorted(
        (holder for holder, held in snapshot.devices.items() if held.get(Resource.MEMORY)),
        key=lambda h: (h.namespace, h.pod, h.container),
    )


def _name(holders: Sequence[Holder]) -> str:
    names = [f"{h.namespace}/{h.pod}/{h.container}" for h in holders[:NAMED_LIMIT]]
    more = len(holders) - NAMED_LIMIT
    return ", ".join(names) + (f" and {more} more" if more > 0 else "")


def _past_the_end(snapshot: Snapshot, units_per_card: Mapping[str, int]) -> list[Holder]:
    """Containers holding a unit number that does not exist under the configured size."""
    found = []
    for holder, held in snapshot.devices.items():
        for device_id in held.get(Resource.MEMORY, ()):
            uuid, _, number = device_id.rpartition(SEPARATOR)
            count = units_per_card.get(uuid)
            digits = number.isascii() and number.isdigit()
            if count is not None and digits and int(number) >= count:
                found.append(holder)
                break
    return sorted(found, key=lambda h: (h.namespace, h.pod, h.container))


def check_unit_size(
    configured: int,
    recorded: int | None,
    snapshot: Snapshot | None,
    units_per_card: Mapping[str, int],
) -> None:
    """Raise :class:`UnitSizeChanged` when ``configured`` MiB units would misread the
    units running containers hold. Pure: the caller reads the file and the records."""
    advice = "or remove the pods holding memory units from this node first"
    if snapshot is None:
        if recorded is not None and recorded != configured:
            raise UnitSizeChanged(
                f"--memory-unit-mib changed from {recorded} to {configured} and the kubelet's "
                "PodResources records cannot be read to confirm that no container holds "
                f"memory units; set --memory-unit-mib {recorded} until they can"
            )
        return
    holders = memory_holders(snapshot)
    if recorded is not None and recorded != configured and holders:
        raise UnitSizeChanged(
            f"--memory-unit-mib changed from {recorded} to {configured} while "
            f"{len(holders)} container(s) hold memory units of {recorded} MiB "
            f"({_name(holders)}); their limits would be counted wrong and the card "
            f"double-booked: set --memory-unit-mib {recorded} until they are gone, {advice}"
        )
    if recorded is None:
        beyond = _past_the_end(snapshot, units_per_card)
        if beyond:
            raise UnitSizeChanged(
                f"containers hold memory units that do not exist with --memory-unit-mib "
                f"{configured} ({_name(beyond)}): the unit size was changed under them; set "
                f"--memory-unit-mib back to the size they were given, {advice}"
            )


def read_recorded(host_dir: Path) -> int | None:
    """The unit size recorded on this node, or None (no record, or one unreadable)."""
    try:
        data = json.loads((host_dir / STATE_FILE).read_text())
        value = data["memoryUnitMib"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning(
            "memory_unit_record_unreadable", path=str(host_dir / STATE_FILE), error=str(exc)
        )
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def write_recorded(host_dir: Path, unit_mib: int) -> None:
    """Record the unit size in effect (atomically); a failure is logged, not fatal."""
    target = host_dir / STATE_FILE
    try:
        data = json.dumps({"memoryUnitMib": unit_mib}).encode()
        replace_file(target, data, 0o644, dir_mode=0o755)
    except OSError as exc:
        log.warning("memory_unit_record_not_written", path=str(target), error=str(exc))


def guard_unit_size(
    host_dir: Path, configured: int, snapshot: Snapshot | None, units_per_card: Mapping[str, int]
) -> None:
    """Check the configured unit size against the node's record and the kubelet's records
    (see the module's doc), then record it. Raises :class:`UnitSizeChanged`."""
    recorded = read_recorded(host_dir)
    check_unit_size(configured, recorded, snapshot, units_per_card)
    if snapshot is None and recorded is None:
        return  # nothing confirmed: record nothing, check again at the next start
    if recorded != configured:
        if recorded is not None:
            log.info("memory_unit_changed", previous_mib=recorded, memory_unit_mib=configured)
        write_recorded(host_dir, configured)
