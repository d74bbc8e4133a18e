"""A node crowded with large pods, served by the API-server double: for the pod watch's
memory bound (docs/security.md, issue 23 item 2).

``python -m gpushare.sim.bigpods --node N --dead 12500 --live 3 --gpu 2``
serves pods of about ``--bytes`` each (a long environment list, the way a tenant makes
them large; the API server accepts objects up to 1.5 MiB) bound to node ``N``: ``--dead``
Failed pods without GPUs, ``--live`` Running pods without GPUs, and ``--gpu`` Pending
pods asking for ``<prefix>/vcuda-memory``. All of them share one environment list in
this process (so 12 500 of them fit in a few MiB here) but each is sent in full. Prints
the double's URL, then serves until standard input closes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from typing import Any

from gpushare.sim.apidouble import KubeApiDouble

ENTRY = {"name": "VARIABLE_00000", "value": "v" * 80}


def environment(size: int) -> list[dict[str, str]]:
    """An environment list whose JSON is about ``size`` bytes."""
    each = len(json.dumps(ENTRY)) + 2
    return [{"name": f"VARIABLE_{i:05d}", "value": "v" * 80} for i in range(max(1, size // each))]


def big_pods(
    node: str,
    *,
    dead: int,
    live: int,
    gpu: int,
    size: int,
    prefix: str = "gpushare.io",
    namespace: str = "tenant",
) -> Iterator[dict[str, Any]]:
    env = environment(size)  # one list, shared by every pod of this process

    def pod(name: str, phase: str, limits: dict[str, str]) -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "nodeName": node,
                "containers": [
                    {
                        "name": "main",
                        "image": "busybox",
                        "env": env,
                        "resources": {"limits": limits},
                    }
                ],
            },
            "status": {"phase": phase},
        }

    for i in range(dead):
        yield pod(f"dead-{i}", "Failed", {"cpu": "100m"})
    for i in range(live):
        yield pod(f"live-{i}", "Running", {"cpu": "100m"})
    for i in range(gpu):
        yield pod(f"gpu-{i}", "Pending", {f"{prefix}/vcuda-memory": "2"})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--node", required=True)
    parser.add_argument("--dead", type=int, default=12)
    parser.add_argument("--live", type=int, default=0)
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--bytes", type=int, default=1_400_000)
    args = parser.parse_args(argv)
    double = KubeApiDouble()
    url = double.start()
    double.add({"apiVersion": "v1", "kind": "Node", "metadata": {"name": args.node}})
    double.add_many(
        big_pods(args.node, dead=args.dead, live=args.live, gpu=args.gpu, size=args.bytes)
    )
    print(url, flush=True)
    sys.stdin.read()
    double.stop()


if __name__ == "__main__":
    main()
