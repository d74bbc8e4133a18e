"""Where the kubelet makes containers' cgroups, and whether the driver's memory limit can
be set there (issue 41 item 4).

NVIDIA's r615 limits have two backends, chosen when the driver loads: ``dmem`` (the
kernel's cgroup controller, 6.14+; the card is a region ``nvidia/<pci bdf>/...`` in the
root's ``dmem.capacity``) and the driver's own ``misc`` map (no cgroup files at all). On
``dmem`` a limit can only be set on a cgroup that has ``dmem.*`` files, i.e. whose parent
enabled ``+dmem`` in ``cgroup.subtree_control``, every level down from the root; NVML
answers "not found" elsewhere. The kubelet (both cgroup drivers) and systemd make
``kubepods[.slice]/<qos>/<pod>/<container>``, and nobody is documented to enable ``dmem``
along that chain: a self-test at the cgroup root can pass while every container's hook
fails. So the daemon reads the chain where containers live, refuses ``driver`` on a
``dmem`` card whose chain is broken (with the level and what an operator can do), and
makes its scratch cgroup beside the pods, not at the root. It never writes a cgroup file
itself: the levels belong to systemd and the kubelet, and a pod made later by them would
not inherit what the daemon enabled once.

Pure reads of a directory tree laid out like ``/sys/fs/cgroup`` (the tests give a temp
directory).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gpushare.gpu.pci import sysfs_bus_id

#: The levels under which the kubelet makes pod cgroups, per cgroup driver, outermost
#: first (Guaranteed pods sit in the first, the others in their QoS class's level).
PARENTS = {
    "systemd": (
        "kubepods.slice",
        "kubepods.slice/kubepods-burstable.slice",
        "kubepods.slice/kubepods-besteffort.slice",
    ),
    "cgroupfs": ("kubepods", "kubepods/burstable", "kubepods/besteffort"),
}
#: At most this many existing pod cgroups are read (a node runs at most a few hundred).
POD_SAMPLE = 64
#: What the driver's ``misc`` backend is forced with (NVIDIA's module option).
FORCE_MISC = 'NVreg_RegistryDwords="RmMemacctMode=1"'


@dataclass(frozen=True)
class PodCgroups:
    """The kubelet's pod cgroups as found under a cgroup root."""

    driver: str  # "systemd", "cgroupfs", or "" where neither layout is there
    parents: tuple[Path, ...] = ()  # the levels of :data:`PARENTS` that exist
    pods: tuple[Path, ...] = ()  # existing pod cgroups (at most :data:`POD_SAMPLE`)

    def scratch_parent(self, root: Path) -> Path:
        """Where the self-test makes its scratch cgroup: beside the pods of the deepest
        level that exists (a pod's place), the root only where no kubelet level exists."""
        return self.parents[-1] if self.parents else root


def pod_cgroups(root: Path) -> PodCgroups:
    """The kubelet's layout under ``root`` (systemd's ``kubepods.slice`` first)."""
    for driver, names in PARENTS.items():
        parents = tuple(root / name for name in names if (root / name).is_dir())
        if not parents:
            continue
        levels = {p.name for p in parents}
        pods: list[Path] = []
        for parent in parents:
            try:
                children = sorted(parent.iterdir())
            except OSError:
                continue
            for child in children:
                if len(pods) >= POD_SAMPLE:
                    break
                if "pod" in child.name and child.name not in levels and child.is_dir():
                    pods.append(child)
        return PodCgroups(driver, parents, tuple(pods))
    return PodCgroups("")


def memacct_backend(root: Path, pci_bus_id: str) -> str:
    """``dmem`` when the root's ``dmem.capacity`` lists a region of this card (or, where
    the card's PCI address is unknown, any ``nvidia/`` region), else ``misc``."""
    try:
        lines = (root / "dmem.capacity").read_text().splitlines()
    except OSError:
        return "misc"
    regions = [line.split()[0] for line in lines if line.strip()]
    nvidia = [r for r in regions if r.startswith("nvidia/")]
    if not pci_bus_id:
        return "dmem" if nvidia else "misc"
    address = sysfs_bus_id(pci_bus_id)
    return "dmem" if any(r.split("/")[1].lower() == address for r in nvidia) else "misc"


def _enables_dmem(directory: Path) -> bool:
    try:
        return "dmem" in (directory / "cgroup.subtree_control").read_text().split()
    except OSError:
        return False


def dmem_gap(root: Path, pods: PodCgroups) -> str | None:
    """The first level on the way from ``root`` to a container's cgroup whose
    ``cgroup.subtree_control`` does not enable ``dmem`` (relative to ``root``, the root
    itself as ``/``), or None where every level read enables it. Checked: the root, the
    kubelet's levels, and every existing pod cgroup (the container's parent); a pod made
    later is checked by the hook, which fails closed."""
    for level in (root, *pods.parents, *pods.pods):
        if not _enables_dmem(level):
            return "/" + str(level.relative_to(root)) if level != root else "/"
    return None


def dmem_obstacle(root: Path, pci_bus_id: str) -> tuple[str, str | None]:
    """(the card's backend, why ``driver`` cannot be set where containers live or None).
    ``misc`` has no chain to check; on ``dmem`` the kubelet's levels must exist and carry
    ``+dmem`` all the way down."""
    backend = memacct_backend(root, pci_bus_id)
    if backend != "dmem":
        return backend, None
    pods = pod_cgroups(root)
    if not pods.parents:
        return backend, (
            f"the driver's dmem backend is in use and no kubelet pod cgroups (kubepods or "
            f"kubepods.slice) are under {root}: where containers live cannot be checked"
        )
    gap = dmem_gap(root, pods)
    if gap is None:
        return backend, None
    return backend, (
        f"the driver's dmem backend needs +dmem in cgroup.subtree_control on every level "
        f"down to a container's cgroup, and {gap} does not enable it ({pods.driver} cgroup "
        f"driver): every container's hook would fail. Force the driver's misc backend "
        f"({FORCE_MISC}) or enable dmem on every level of the kubelet's cgroups"
    )
