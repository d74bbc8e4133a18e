"""The kernel's tables of ``<name> <number>`` lines, as procfs, sysfs and cgroupfs write
them (``/proc/driver/nvidia-caps/mig-minors``, a cgroup's ``dmem.capacity``)."""

from __future__ import annotations


def named_numbers(text: str) -> dict[str, int]:
    """Each ``<name> <decimal>`` line of ``text`` as name -> number; any other line
    (blank, more or fewer words, a value that is no whole number) is skipped."""
    table = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            table[parts[0]] = int(parts[1])
    return table
