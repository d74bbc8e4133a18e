"""``kubectl gpushare``: a kubectl plugin with five subcommands.

* ``inspect``   per-card use of gpushare nodes (:mod:`gpushare.ops.inspect`);
* ``verify``    prove on a node that the limits are enforced (:mod:`gpushare.ops.verify`);
* ``install``   apply the shipped manifests and opt nodes in by label;
* ``uninstall`` opt nodes out; with none left, delete what ``install`` created;
* ``version``   this plugin's version (no cluster needed).

Like kubectl, ``--kubeconfig`` and ``--context`` are accepted before or after the
subcommand. Without a usable kubeconfig or a reachable API server every subcommand
prints one line on stderr and exits 2. ``--help`` and ``version`` import nothing of
the ``kubernetes`` client: it is imported by the first command that talks to a cluster.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence

import yaml

from gpushare import __version__
from gpushare.base.cli import Parser, add_version, bounded_float
from gpushare.config import Settings
from gpushare.kube.kubectlapi import EXIT_NO_CLUSTER, ApiError, Cluster, NoCluster
from gpushare.ops import deploy, inspect, verify

PROG = "kubectl gpushare"
#: Refusals that need the operator to say more (no --node without a terminal).
EXIT_USAGE = 2
#: uninstall: a node's host cleanup pod did not run or did not report (it says why)
EXIT_HOST_CLEANUP = 3


def _say(line: str) -> None:
    print(line, flush=True)


def _fail(command: str, message: str, code: int) -> int:
    print(f"{PROG} {command}: {message}".replace("\n", " "), file=sys.stderr)
    return code


def choose_nodes(candidates: Sequence[str], answer: str) -> list[str]:
    """The nodes an operator picked: numbers (1-based) or names, or ``all``."""
    picked: list[str] = []
    for word in answer.replace(",", " ").split():
        if word.lower() == "all":
            return list(candidates)
        if word.isdigit() and 1 <= int(word) <= len(candidates):
            name = candidates[int(word) - 1]
        elif word in candidates:
            name = word
        else:
            raise ValueError(f"{word!r} is not one of the listed nodes")
        if name not in picked:
            picked.append(name)
    return picked


def _ask_for_nodes(cluster: Cluster) -> list[str]:
    candidates = deploy.gpu_nodes(cluster)
    if not candidates:
        raise deploy.DeployError(
            f"no node reports an NVIDIA GPU (label {deploy.GPU_PRESENT_LABEL}=true or "
            f"{deploy.GPU_PRODUCT_LABEL}); name nodes with --node"
        )
    print("Nodes with NVIDIA GPUs:")
    for number, name in enumerate(candidates, 1):
        print(f"  {number}  {name}")
    answer = input("Install gpushare on which nodes? (numbers or names, 'all'; empty to cancel): ")
    return choose_nodes(candidates, answer)


def _install(args: argparse.Namespace) -> int:
    nodes: list[str] = list(dict.fromkeys(args.node or []))
    if not nodes and not sys.stdin.isatty():
        return _fail(
            "install",
            "no --node given and stdin is not a terminal to ask on; name nodes with --node NAME",
            EXIT_USAGE,
        )
    cluster = Cluster(args.kubeconfig, args.context)
    if not nodes:
        try:
            nodes = _ask_for_nodes(cluster)
        except (ValueError, EOFError) as exc:
            return _fail("install", str(exc) or "no answer", 1)
        if not nodes:
            return _fail("install", "no node chosen; nothing done", 1)
    deploy.install(
        cluster,
        nodes,
        _say,
        image=args.image,
        runtime_class=args.runtime_class,
        dry_run=args.dry_run,
    )
    return 0


def _uninstall(args: argparse.Namespace) -> int:
    nodes = list(dict.fromkeys(args.node or []))
    if nodes and args.all:
        return _fail("uninstall", "--all and --node exclude each other", EXIT_USAGE)
    terminal = sys.stdin.isatty()
    if not nodes and not args.all and not args.dry_run and not terminal:
        return _fail(
            "uninstall",
            "no --node given and stdin is not a terminal to confirm on; name nodes with "
            "--node NAME, or --all to remove gpushare from every node and delete its objects",
            EXIT_USAGE,
        )
    cluster = Cluster(args.kubeconfig, args.context)
    plan = deploy.plan_uninstall(cluster, nodes)
    steps = plan.lines()
    if not steps:
        _say("nothing to remove: no node is labelled and no gpushare object exists")
        return 0
    _say(f"kubectl gpushare uninstall {'would' if args.dry_run else 'will'}:")
    for step in steps:
        _say(f"  {step}")
    if args.dry_run:
        _say("dry run: nothing changed")
        return 0
    if terminal and not args.yes:
        try:
            answer = input("Go ahead? [y/N]: ")
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            return _fail("uninstall", "not confirmed; nothing done", 1)
    cleaned = deploy.uninstall(
        cluster,
        plan,
        _say,
        wait_seconds=args.wait,
        cleanup_seconds=args.cleanup_wait,
        image=args.image,
        clean_hosts=not args.keep_host,
    )
    return 0 if cleaned else EXIT_HOST_CLEANUP


def _verify(args: argparse.Namespace) -> int:
    request = verify.VerifyRequest(
        node=args.node,
        namespace=args.namespace,
        image=args.image,
        memory_units=args.memory_units,
        core_units=args.core_units,
        prefix=args.resource_prefix,
        runtime_class=args.runtime_class,
        timeout_seconds=args.timeout,
        keep=args.keep,
        backends=tuple(args.backend or ()),
        memory_unit_mib=args.memory_unit_mib,
    )
    try:
        return verify.run(Cluster(args.kubeconfig, args.context), request, _say)
    except verify.BadRequest as exc:
        return _fail("verify", str(exc), EXIT_USAGE)


def _version(args: argparse.Namespace) -> int:
    info = {"clientVersion": {"version": __version__, "python": platform.python_version()}}
    if args.output == "json":
        print(json.dumps(info, indent=2))
    elif args.output == "yaml":
        print(yaml.safe_dump(info, sort_keys=False), end="")
    else:
        print(f"{PROG} {__version__}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog=PROG,
        description="Share NVIDIA GPUs between containers: inspect, install, uninstall.",
        epilog="--kubeconfig FILE and --context NAME work as kubectl's, before or after COMMAND.",
    )
    add_version(parser)
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=Parser
    )
    commands.add_parser(
        "inspect", help="per-card GPU memory and core use (kubectl gpushare inspect -h)"
    )
    version = commands.add_parser("version", help="print the plugin's version")
    version.add_argument("-o", "--output", choices=("json", "yaml"), help="json or yaml")
    install = commands.add_parser(
        "install",
        help="apply the gpushare manifests and label nodes",
        description="Server-side apply the gpushare DaemonSet and its RBAC (kube-system), then "
        "label the chosen nodes so the DaemonSet runs there. Without --node, lists the nodes "
        "that report NVIDIA GPUs and asks (only on a terminal).",
    )
    install.add_argument("--node", action="append", metavar="NAME", help="opt this node in")
    inspect.add_cluster_flags(install)
    install.add_argument(
        "--image",
        metavar="REF",
        help="the gpushare image the DaemonSet runs (default: what an earlier install set, "
        "else the shipped manifest's)",
    )
    install.add_argument(
        "--runtime-class",
        metavar="NAME",
        help="RuntimeClass of the NVIDIA runtime (e.g. nvidia), where it is not the default "
        "runtime (default: what an earlier install set, else none)",
    )
    install.add_argument(
        "--dry-run",
        action="store_true",
        help="check everything and say what would be applied and labelled; change nothing",
    )
    check = commands.add_parser(
        "verify",
        help="prove on a node that memory and core limits are enforced (runs a probe pod)",
        description="Run a short-lived pod on NODE asking for a small share, with the gpushare "
        "image's enforcement probe, and print its verdict: memory (allocations stop at the "
        "limit, cuMemGetInfo and NVML report it, cuMemAllocAsync and cuMemCreate cannot pass "
        "it, two processes share it), compute (throughput at the core limit) and what the "
        "container sees. Exit 0: enforced; 1: a limit is not; 3: the pod did not report.",
    )
    check.add_argument("--node", required=True, metavar="NAME", help="the node to verify")
    inspect.add_cluster_flags(check)
    check.add_argument("-n", "--namespace", default="default", metavar="NS",
                       help="namespace of the probe pod (default: default)")  # fmt: skip
    check.add_argument(
        "--image", metavar="REF", help="image with the probe (default: the installed DaemonSet's)"
    )
    check.add_argument("--memory-units", type=int, default=4, metavar="N",
                       help="vcuda-memory units the probe asks for (default: 4)")  # fmt: skip
    check.add_argument("--core-units", type=int, default=30, metavar="N",
                       help="vcuda-core units the probe asks for (default: 30)")  # fmt: skip
    check.add_argument(
        "--runtime-class",
        metavar="NAME",
        help="RuntimeClass of the NVIDIA runtime, if not the default",
    )
    check.add_argument("--resource-prefix", default=Settings().resource_prefix, metavar="PREFIX",
                       help="prefix of gpushare's resources (default: %(default)s)")  # fmt: skip
    check.add_argument("--timeout", type=bounded_float(1, 3600), default=300.0, metavar="SECONDS",
                       help="how long to wait for the probe (default: %(default).0f)")  # fmt: skip
    check.add_argument("--keep", action="store_true", help="leave the pod for inspection")
    check.add_argument("--backend", action="append", choices=verify.VERIFIABLE,
                       help="verify under this memory backend (repeatable; default: each one "
                       "the node's cards have)")  # fmt: skip
    check.add_argument("--memory-unit-mib", type=int, default=Settings().memory_unit_mib,
                       metavar="MIB", help="the node's unit size, for a driver claim's memory "
                       "(default: %(default)s)")  # fmt: skip
    uninstall = commands.add_parser(
        "uninstall",
        help="unlabel nodes; with none left, delete what install created",
        description="Remove the opt-in label from the named nodes (with --all, or when none "
        "is named and you confirm on a terminal: every node). When no node keeps it, delete "
        "the objects kubectl gpushare install created; objects it did not create are never "
        "touched. It first lists what it will remove and, on a terminal, asks.",
    )
    uninstall.add_argument("--node", action="append", metavar="NAME", help="opt this node out")
    uninstall.add_argument(
        "--all",
        action="store_true",
        help="every node, then delete what install created (needed without --node when "
        "stdin is not a terminal)",
    )
    uninstall.add_argument(
        "--dry-run", action="store_true", help="say what would be removed; change nothing"
    )
    uninstall.add_argument(
        "-y", "--yes", action="store_true", help="do not ask on a terminal before removing"
    )
    inspect.add_cluster_flags(uninstall)
    uninstall.add_argument(
        "--wait",
        type=bounded_float(0, 3600),
        default=deploy.UNINSTALL_WAIT_SECONDS,
        metavar="SECONDS",
        help="how long to wait for the daemon pod to leave a node before removing what it "
        "published there (default: %(default).0f)",
    )
    uninstall.add_argument(
        "--cleanup-wait",
        type=bounded_float(1, 3600),
        default=deploy.CLEANUP_WAIT_SECONDS,
        metavar="SECONDS",
        help="how long to wait for each node's host cleanup pod to report (default: "
        "%(default).0f)",
    )
    uninstall.add_argument(
        "--image",
        metavar="REF",
        help="the image of the host cleanup pods (default: the installed DaemonSet's, or "
        "the one an unfinished cleanup recorded on the node)",
    )
    uninstall.add_argument(
        "--keep-host",
        action="store_true",
        help="no host cleanup pod: leave the node's host directory, tmpfs, sockets and "
        "CDI specs as the daemon left them (docs/deploy.md)",
    )
    return parser


#: kubectl's global flags that every cluster command takes, before or after COMMAND.
GLOBAL_FLAGS = ("--kubeconfig", "--context")


def move_global_flags(argv: Sequence[str]) -> list[str]:
    """``--kubeconfig X inspect`` -> ``inspect --kubeconfig=X``: kubectl's global flags
    may come before the subcommand; each subcommand's parser takes them."""
    before: list[str] = []
    rest = list(argv)
    while rest and rest[0].split("=", 1)[0] in GLOBAL_FLAGS:
        flag = rest.pop(0)
        if "=" not in flag and rest:
            flag = f"{flag}={rest.pop(0)}"
        before.append(flag)
    if not before or not rest:
        return [*before, *rest]
    return [rest[0], *before, *rest[1:]]


def main(argv: Sequence[str] | None = None) -> int:
    argv = move_global_flags(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "inspect":
        return inspect.main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command == "version":
        return _version(args)
    try:
        if args.command == "install":
            return _install(args)
        if args.command == "verify":
            return _verify(args)
        return _uninstall(args)
    except NoCluster as exc:
        return _fail(args.command, str(exc), EXIT_NO_CLUSTER)
    except (deploy.DeployError, ApiError) as exc:
        return _fail(args.command, str(exc), 1)
    except KeyboardInterrupt:
        return _fail(args.command, "interrupted", 130)


if __name__ == "__main__":
    sys.exit(main())
