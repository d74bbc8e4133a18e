"""A kubelet stand-in for the host cleanup pods of ``kubectl gpushare uninstall`` on the
API server double: it ends every cleanup pod it sees as a kubelet would once the
container exited, with the report given as its termination message (the edge: no pod
runs on the double, and the host side is tested on its own, tests/unit/host/)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from gpushare.ops.hostcleanup import POD_LABEL
from kit.kube_double import KubeApiDouble

#: what a cleanup that removed everything reports
CLEAN_REPORT: dict[str, Any] = {
    "removed": 3,
    "unmounted": ["containers"],
    "host_dir_removed": True,
    "kept": {},
    "failed": {},
}


class CleanupKubelet:
    """Ends each new cleanup pod with ``report`` (exit ``exit_code``); ``seen`` lists the
    pods it ended, as they were created."""

    def __init__(self, api: KubeApiDouble, report: Any, exit_code: int = 0) -> None:
        self.api = api
        self.report = report
        self.exit_code = exit_code
        #: the termination message (default: the report as JSON)
        self.message = json.dumps(report)
        self.seen: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _pending(self) -> list[dict[str, Any]]:
        pods = [
            obj
            for obj in list(self.api.objects.values())
            if obj.get("kind") == "Pod"
            and (obj["metadata"].get("labels") or {}).get(POD_LABEL[0]) == POD_LABEL[1]
            and not (obj.get("status") or {}).get("containerStatuses")
        ]
        return [json.loads(json.dumps(pod)) for pod in pods]

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for pod in self._pending():
                self.seen.append(json.loads(json.dumps(pod)))
                state = {"exitCode": self.exit_code, "message": self.message}
                pod["status"] = {
                    "phase": "Succeeded" if self.exit_code == 0 else "Failed",
                    "containerStatuses": [{"name": "cleanup", "state": {"terminated": state}}],
                }
                self.api.add(pod)

    @contextmanager
    def running(self) -> Iterator[CleanupKubelet]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join()
