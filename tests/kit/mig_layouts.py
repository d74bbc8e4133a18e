"""Simulated MIG layouts for the tests (entries of the simulated node file)."""

from __future__ import annotations

from typing import Any

#: The card of the reference document (004): an A100-SXM4-40GB partitioned with
#: ``nvidia-smi mig -cgi 9,14,19,19``: GPU instances 2 (3g.20gb), 3 (2g.10gb),
#: 9 and 10 (1g.5gb), one compute instance 0 in each; sizes as its nvidia-smi shows.
A100_UUID = "GPU-7780f282-99a1-7024-f7a4-65a55230ed76"


def mig_uuid(n: int) -> str:
    return f"MIG-{n:08x}-7780-5000-8000-65a55230ed76"


def reference_a100(uuid: str = A100_UUID, index: int = 0, first: int = 0) -> dict[str, Any]:
    return {
        "uuid": uuid,
        "name": "A100-SXM4-40GB",
        "memory_mib": 40536,
        "index": index,
        "numa_node": 0,
        "mig": True,
        "instances": [
            {"uuid": mig_uuid(first + 0), "profile": "3g.20gb", "memory_mib": 20096, "gi": 2,
             "ci": 0, "sm": 42},
            {"uuid": mig_uuid(first + 1), "profile": "2g.10gb", "memory_mib": 9984, "gi": 3,
             "ci": 0, "sm": 28},
            {"uuid": mig_uuid(first + 2), "profile": "1g.5gb", "memory_mib": 4864, "gi": 9,
             "ci": 0, "sm": 14},
            {"uuid": mig_uuid(first + 3), "profile": "1g.5gb", "memory_mib": 4864, "gi": 10,
             "ci": 0, "sm": 14},
        ],
    }


def uniform_a100(uuid: str, index: int, first: int) -> dict[str, Any]:
    """An A100-40GB cut into seven 1g.5gb devices."""
    card = reference_a100(uuid, index, first)
    card["instances"] = [
        {"uuid": mig_uuid(first + i), "profile": "1g.5gb", "memory_mib": 4864, "gi": 7 + i,
         "ci": 0, "sm": 14}
        for i in range(7)
    ]
    return card
