"""The status a real kubelet writes for a pod whose one container has exited, for the
stand-ins that finish pods in place of a node (the walk-through's probe node, the fast
suite's verify tests).

Seen with containerd 2.4 and runc under kubelets 1.36 and 1.37
(tests/e2e/test_verify_real.py): a ``restartPolicy: Never`` pod ends in phase ``Succeeded``
or ``Failed``, and its container's state is ``terminated`` with its exit code and the
reason ``Completed`` (exit 0) or ``Error`` (any other); `kubectl gpushare verify` prints
that reason beside the phase. A stand-in that wrote the phase alone made verify print
less than it does on a node (e2e/README.md, "What the stand-ins get wrong").
"""

from __future__ import annotations

from typing import Any


def ended_status(container: str, exit_code: int) -> dict[str, Any]:
    """The pod's ``status`` fields once ``container`` (its only one) exited ``exit_code``."""
    reason = "Completed" if exit_code == 0 else "Error"
    return {
        "phase": "Succeeded" if exit_code == 0 else "Failed",
        "containerStatuses": [
            {
                "name": container,
                "ready": False,
                "restartCount": 0,
                "started": False,
                "state": {"terminated": {"exitCode": exit_code, "reason": reason}},
            }
        ],
    }
