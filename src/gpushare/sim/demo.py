"""``make demo``: the daemon on a simulated node of three Tesla P4, admitted to by a
simulated kubelet: a training container that takes a whole card, the three shared
containers from the reference documents beside it, then one that does not fit. It
shows what each container finally sees (the kubelet merges the answers of both
resources) and the refusal's message. Nothing is enforced here: there is no GPU and no
HAMi-core in a simulation."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

from gpushare.base.cli import Parser, add_version
from gpushare.base.logs import configure_logging
from gpushare.base.startup import StartupError
from gpushare.config import LOG_LEVELS, Settings
from gpushare.daemon import Daemon
from gpushare.host.elf import stand_in
from gpushare.share.devices import Inventory, Resource
from gpushare.sim.kubeletdouble import AdmissionError, Admitted, SimulatedKubelet

THREE_TESLA_P4 = {
    "gpus": [
        {
            "uuid": "GPU-9f12f917-e458-4bb8-3d9d-8dc7fd6cddf7",
            "name": "Tesla P4",
            "memory_mib": 7611,
            "numa_node": 0,
        },
        {
            "uuid": "GPU-4c2e1a3b-77d1-4f0e-9a56-0b6c1d2e3f40",
            "name": "Tesla P4",
            "memory_mib": 7611,
            "numa_node": 1,
        },
        {
            "uuid": "GPU-d81c0e6a-2b4f-4a51-8c3e-5f7a9b1c2d3e",
            "name": "Tesla P4",
            "memory_mib": 7611,
            "numa_node": 1,
        },
    ]
}

#: (pod, memory units, core units), as the reference documents' users asked; the last
#: one does not fit on one card (5 and 9 units are left) and is refused.
CONTAINERS = [("pod-a", 4, 10), ("pod-b", 20, 30), ("pod-c", 20, 30), ("pod-d", 10, 10)]

NOT_ENFORCED = (
    "Simulation: nothing above is enforced (no GPU, no HAMi-core). On a real node the\n"
    "runtime gives the container only the card named in NVIDIA_VISIBLE_DEVICES, and\n"
    "libvgpu.so, preloaded from the mounts above, holds it to the memory limit and\n"
    "throttles it to its SM share."
)


def print_container_view(admitted: Admitted) -> None:
    """What the container finally sees: the answers of both resources, merged the way
    the kubelet merges them (one value per env name, one mount per container path)."""
    answers = ", ".join(
        f"{resource.rsplit('/', 1)[-1]} ({len(ids)} units)"
        for resource, ids in admitted.devices.items()
    )
    print(f"    what the container sees (merged from the answers for {answers}):")
    for name, value in sorted(admitted.envs.items()):
        print(f"      env   {name}={value}")
    for path, mount in sorted(admitted.mounts.items()):
        mode = "ro" if mount.read_only else "rw"
        print(f"      mount {mount.host_path} -> {path} ({mode})")
    for name, value in sorted(admitted.annotations.items()):
        print(f"      annotation {name}={value}")
    for conflict in admitted.conflicts:
        print(f"      CONFLICT {conflict}")


def run_demo(workdir: Path) -> int:
    settings = _node_settings(workdir)
    kubelet = SimulatedKubelet(Path(settings.kubelet_dir), Path(settings.pod_resources_socket))
    kubelet.start()
    daemon = Daemon(settings, kubelet_version=lambda: kubelet.version)
    memory, core = settings.memory_resource, settings.core_resource
    whole = f"{settings.resource_prefix}/gpu"
    try:
        daemon.start()
        print(f"simulated node: {settings.simulate} (3 x Tesla P4, 7611 MiB)")
        if not kubelet.wait_for(
            lambda k: bool(k.devices(memory)) and bool(k.devices(core)) and bool(k.devices(whole))
        ):
            print("the plugin did not register within 30 s", file=sys.stderr)
            return 1
        _show_registrations(kubelet, settings)
        _admit(kubelet, memory, core, whole)
        assert daemon.core is not None
        _show_cards(daemon.core.inventory, kubelet, memory, core, whole)
        print()
        print(NOT_ENFORCED)
    except StartupError as exc:
        print(f"gpushare-demo: {exc}", file=sys.stderr)
        return 1
    finally:
        daemon.stop()
        kubelet.stop()
    return 0


def _node_settings(workdir: Path) -> Settings:
    """The simulated node of three Tesla P4 under ``workdir``, whole cards offered too."""
    node_file = workdir / "node.yaml"
    node_file.write_text(yaml.safe_dump(THREE_TESLA_P4))
    library = workdir / "libvgpu.so"
    library.write_bytes(
        stand_in(b"placeholder for HAMi-core libvgpu.so (the demo enforces nothing)\n")
    )
    return Settings(
        kubelet_dir=str(workdir / "device-plugins"),
        pod_resources_socket=str(workdir / "pod-resources" / "kubelet.sock"),
        simulate=str(node_file),
        library=str(library),
        host_lib_dir=str(workdir / "vgpu"),
        metrics_port=0,
        whole_cards=True,
    )


def _show_registrations(kubelet: SimulatedKubelet, settings: Settings) -> None:
    print("\nregistered with the kubelet:")
    for resource, endpoint in kubelet.registrations:
        print(f"  {resource:28} endpoint {endpoint:28} {len(kubelet.devices(resource))} devices")
    print(
        f"  ({settings.memory_unit_mib} MiB per memory unit: floor(7611/256) = 29 per card; "
        "100 core units per card; one whole-card device per card)"
    )


def _admit(kubelet: SimulatedKubelet, memory: str, core: str, whole: str) -> None:
    """A whole card, the shared containers, then a whole card that cannot be had."""
    print("\nadmitting a training container asking for a whole card:")
    for pod in ("train-a",):
        try:
            admitted = kubelet.admit(pod, "main", {whole: 1})
        except AdmissionError as exc:
            print(f"  {pod}: NOT admitted: {exc}")
            continue
        print(f"  {pod}/main: 1 whole card -> {admitted.card()}")
        print_container_view(admitted)

    print(
        "\nadmitting containers the way the kubelet does "
        "(GetPreferredAllocation, then Allocate; core first):"
    )
    for pod, memory_units, core_units in CONTAINERS:
        try:
            admitted = kubelet.admit(
                pod, "main", {core: core_units, memory: memory_units}, order=[core, memory]
            )
        except AdmissionError as exc:
            print(
                f"  {pod}/main: {memory_units} memory units + {core_units} core units "
                "-> NOT admitted"
            )
            print(f"    the pod fails with: {exc}")
            continue
        print(
            f"  {pod}/main: {memory_units} memory units + {core_units} core units "
            f"-> card {admitted.card()}"
        )
        print_container_view(admitted)

    print(
        "\nanother whole card? Cards with shared units in use are listed Unhealthy as "
        "whole cards, so the kubelet has none to give:"
    )
    try:
        kubelet.admit("train-b", "main", {whole: 1})
        print("  train-b: admitted (unexpected)")
    except AdmissionError as exc:
        print(f"  train-b: NOT admitted: {exc}")


def _show_cards(
    inventory: Inventory, kubelet: SimulatedKubelet, memory: str, core: str, whole: str
) -> None:
    print("\nper card (from the kubelet's allocations):")
    print(f"  {'GPU':4} {'UUID':42} {'memory units':>14} {'core units':>12}  containers")
    held_whole = kubelet.allocated(whole)
    for card in inventory.cards.values():
        mem_used = sum(1 for d in kubelet.allocated(memory) if d.startswith(card.uuid + "::"))
        core_used = sum(1 for d in kubelet.allocated(core) if d.startswith(card.uuid + "::"))
        pods = sorted(a.pod for a in kubelet.admitted.values() if a.card() == card.uuid)
        if card.uuid in held_whole:
            pods = [f"{p} (whole card)" for p in pods]
        print(
            f"  {card.gpu.index:<4} {card.uuid:42} "
            f"{f'{mem_used}/{card.memory_units}':>14} "
            f"{f'{core_used}/{card.units(Resource.CORE)}':>12}  {', '.join(pods)}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser(prog="gpushare-demo", description=__doc__)
    add_version(parser)
    parser.add_argument(
        "--log-level",
        default="error",
        choices=LOG_LEVELS,
        help="daemon log level (default error: the demo prints what matters itself)",
    )
    args = parser.parse_args(argv)
    configure_logging("console", args.log_level)
    with tempfile.TemporaryDirectory(prefix="gpushare-demo-") as tmp:
        return run_demo(Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
