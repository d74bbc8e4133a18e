"""The host cleanup of ``kubectl gpushare uninstall``: one run, in a one-shot pod.

``python -m gpushare.node.hostsweep [--held-claims UIDS | --claims-unknown] -- <the
daemon's arguments>`` runs in the pod ``ops/hostcleanup.py`` makes on a node whose daemon
has gone: the installed DaemonSet's image, arguments, environment and hostPaths (so it
reads the same settings and sees the same paths as the daemon did), privileged with
the host directory's hostPath Bidirectional (to unmount the cache tmpfs on the host).
It reads the kubelet's PodResources once (what running containers hold), decides
(``host/sweepplan.py``, ``host/leftovers.py``) and applies (``host/sweep.py``), then
writes its report, one JSON object, to ``--report`` (the pod's termination message,
``/dev/termination-log``: the CLI reads it from the pod's status, no log access needed)
and to stdout. Which DRA claims are in use is the CLI's to say (``--held-claims``: it
reads the ResourceClaims); without the PodResources read nothing is removed.

Exit status: 0 done (names may be kept, the report says why), 1 something could not be
removed or unmounted, 2 bad arguments, 3 the kubelet's PodResources could not be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc

from gpushare._proto.podresources.v1 import api_pb2
from gpushare.config import ConfigError, Settings, load_settings
from gpushare.host.gc import holder_keys, live_grants, live_keys
from gpushare.host.leftovers import Held
from gpushare.host.sweep import Dirs, clean, summary
from gpushare.host.sweepplan import Naming
from gpushare.node.podresources import LIST_METHOD, parse_list_response
from gpushare.share.devices import Resource
from gpushare.share.records import Snapshot

#: The kubelet keeps at most 4096 bytes of a termination message.
REPORT_LIMIT = 4000
LIST_TIMEOUT = 10.0
EXIT_FAILED, EXIT_USAGE, EXIT_NO_RECORDS = 1, 2, 3


def read_pod_resources(socket: Path, prefix: str) -> Snapshot | None:
    """One PodResources List: every container's units of ours; every other resource
    counted as exclusive (its grant specs kept while held). None when unreadable."""
    channel = grpc.insecure_channel(f"unix://{socket}")
    try:
        call = channel.unary_unary(
            LIST_METHOD,
            request_serializer=api_pb2.ListPodResourcesRequest.SerializeToString,
            response_deserializer=api_pb2.ListPodResourcesResponse.FromString,
        )
        response = call(api_pb2.ListPodResourcesRequest(), timeout=LIST_TIMEOUT)
    except grpc.RpcError:
        return None
    finally:
        channel.close()
    shared = {resource.name_with(prefix): resource for resource in Resource}
    others = {
        devices.resource_name
        for pod in response.pod_resources
        for container in pod.containers
        for devices in container.devices
        if devices.resource_name not in shared
    }
    return parse_list_response(response, shared, 0.0, others)


def held_of(snapshot: Snapshot, claim_uids: frozenset[str] | None) -> Held:
    """What the containers of ``snapshot`` and the claims in use hold (``None``: the
    claims in use are not known, every claim's files are kept)."""
    return Held(
        cache_keys=frozenset(live_keys(snapshot)),
        holders=frozenset(holder_keys(snapshot)),
        claims=claim_uids is None or bool(claim_uids),
        grants=frozenset(live_grants(snapshot)),
        claim_uids=claim_uids,
    )


def dirs_of(settings: Settings, host_parent: str = "") -> Dirs:
    cdi = [Path(settings.dra_cdi_dir)]
    return Dirs(
        host_parent=Path(host_parent) if host_parent else None,
        host_dir=Path(settings.host_lib_dir),
        device_plugins=Path(settings.kubelet_dir),
        kubelet_root=Path(settings.dra_kubelet_root),
        driver=settings.dra_driver,
        cdi=cdi,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m gpushare.node.hostsweep",
        description="remove what gpushare left on this node (run by kubectl gpushare uninstall)",
    )
    claims = parser.add_mutually_exclusive_group()
    claims.add_argument(
        "--held-claims", default="", metavar="UIDS", help="the UIDs of the DRA claims in use"
    )
    claims.add_argument(
        "--claims-unknown", action="store_true", help="not known: keep every claim's files"
    )
    parser.add_argument("--report", default="/dev/termination-log", metavar="PATH")
    parser.add_argument(
        "--host-lib-parent",
        default="",
        metavar="PATH",
        help="where the host directory's parent is mounted (to remove the host directory)",
    )
    return parser


def _write(report: Mapping[str, object], path: str) -> None:
    text = json.dumps(report, sort_keys=True)
    print(text)
    try:
        Path(path).write_text(text)
    except OSError as exc:
        print(f"cannot write the report to {path}: {exc}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args, daemon_args = _parser().parse_known_args(argv)
    daemon_args = [a for a in daemon_args if a != "--"]
    try:
        settings = load_settings(daemon_args)
    except ConfigError as exc:
        _write({"error": f"the daemon's settings: {exc}"}, args.report)
        return EXIT_USAGE
    snapshot = read_pod_resources(Path(settings.pod_resources_socket), settings.resource_prefix)
    if snapshot is None:
        why = f"the kubelet's PodResources ({settings.pod_resources_socket}) cannot be read"
        _write({"error": f"{why}: nothing removed"}, args.report)
        return EXIT_NO_RECORDS
    uids = None if args.claims_unknown else frozenset(filter(None, args.held_claims.split(",")))
    naming = Naming(settings.resource_prefix, settings.dra_driver)
    outcome = clean(dirs_of(settings, args.host_lib_parent), naming, held_of(snapshot, uids))
    _write(summary(outcome, REPORT_LIMIT), args.report)
    return EXIT_FAILED if outcome.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
