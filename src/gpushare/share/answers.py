"""The answer port: the ONE place where a grant becomes container edits. Pure.

A :class:`Grant` says what one container (or one claim's result) gets: which devices
(cards or MIG devices, in the order the container sees them), whole or a share
(memory, cores), and the card's :class:`Enforcement`. :func:`container_edits` turns it
into :class:`ContainerEdits`, the edits the runtime applies: environment, mounts, device
nodes (``device_specs``), the devices' names (``NVIDIA_VISIBLE_DEVICES`` and/or CDI
names, as the node's :class:`DeviceListing` says) and OCI hooks (:class:`Hook`: the
driver memory hook, the limit check). Every front door calls it (shared units and whole
cards in ``deviceplugin/shareplan.py`` and ``deviceplugin/exclusive.py``, MIG devices in
``deviceplugin/migserve.py``, DRA claims in ``dra/claimplan.py``); a door only chooses
the grant and translates the edits to its wire format (``deviceplugin/plugin.py``'s
``answer_to_proto``, ``host/cdi.py``'s ``claim_device``). ``tests/test_layout.py``
checks that no other module builds edits.

A container that asks for both shared resources gets two answers, one per resource,
which the kubelet merges (the first value of a key wins, a differing second value is
only logged). So each answer sets only what belongs to its resource, and anything both
answers set is identical:

* both: ``NVIDIA_VISIBLE_DEVICES`` (the same card, by construction), ``LD_PRELOAD``,
  the library mount and the lock directory mount;
* memory only: ``CUDA_DEVICE_MEMORY_LIMIT_0``, the per-container cache directory and
  ``CUDA_DEVICE_MEMORY_SHARED_CACHE``;
* core only: ``CUDA_DEVICE_SM_LIMIT``.

A variable that is not set means "no limit" to libvgpu: memory without core runs
unthrottled, core without memory may use the whole card's memory. A DRA claim grants
both limits at once and gets in one answer what the kubelet merges from the device
plugin's two.

Whole devices get the raw devices, or, with the card's enforcement
(``exclusiveEnforcement``), the interposer with 100 % limits:
``CUDA_DEVICE_MEMORY_LIMIT_<i>`` = the whole memory of device ``i``,
``CUDA_DEVICE_SM_LIMIT=100``, so a site keeps the same accounting everywhere.

A DRA claim's share (``every_index``) sets its limits under every name HAMi-core reads
for them, ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` and ``CUDA_DEVICE_SM_LIMIT_<i>`` for i from 0
to 15, and ``GPU_CORE_UTILIZATION_POLICY=default``, ``CUDA_DISABLE_CONTROL=false``: its
container's own env is not checked (issue 32 item 1), and its CDI spec, applied last,
replaces exactly the names it sets.
It also carries the createRuntime hook :func:`limit_check` with its share: another claim
of the same container may set every index to a larger one (the runtime applies the specs
in turn), and the check refuses that container before it runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

CONTAINER_LIBRARY = "/usr/local/vgpu/libvgpu.so"
CONTAINER_CACHE_DIR = "/usr/local/vgpu/cache"
CONTAINER_CACHE_FILE = f"{CONTAINER_CACHE_DIR}/vgpu.cache"
LOCK_DIR = "/tmp/vgpulock"
LD_SO_PRELOAD = "/etc/ld.so.preload"

ANNOTATION_NO_ENFORCEMENT = "gpushare.io/enforcement"

#: The environment the edits set (read back by logs and tests; only this module sets them).
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
MEMORY_LIMIT = "CUDA_DEVICE_MEMORY_LIMIT_0"  # of the first (a share's only) device
#: HAMi-core's fallback: the limit of every index without its own ``_<i>`` (its
#: ``do_init_device_memory_limits``); ``CUDA_DEVICE_SM_LIMIT`` is the same for cores.
MEMORY_LIMIT_EVERY_INDEX = "CUDA_DEVICE_MEMORY_LIMIT"
CORE_LIMIT = "CUDA_DEVICE_SM_LIMIT"
SHARED_CACHE = "CUDA_DEVICE_MEMORY_SHARED_CACHE"
PRELOAD = "LD_PRELOAD"
#: MPS: the client's pipe directory (mounted there), its thread cap and pinned memory.
MPS_PIPE = "CUDA_MPS_PIPE_DIRECTORY"
MPS_THREADS = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"
MPS_PINNED_MEMORY = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
CONTAINER_MPS_PIPE = "/tmp/nvidia-mps"
CONTAINER_SHM = "/dev/shm"


#: HAMi-core's ``CUDA_DEVICE_MAX_COUNT``: it reads the per-index limits of indices 0 to 15
#: and no more, whatever the node holds, so an ``every_index`` grant sets all of them.
INTERPOSER_INDEXES = 16
#: HAMi-core's switches, set by an ``every_index`` grant to the value that behaves as if
#: the name were unset (read in HAMi-core's source, the same since its first release):
#: ``GPU_CORE_UTILIZATION_POLICY`` (default/force/disable; disable drops the core limit),
#: ``CUDA_DISABLE_CONTROL`` (default false; true drops every limit), ``CUDA_REDIRECT``
#: (a library its ``dlsym`` resolves into instead of ``/usr/local/vgpu/libvgpu.so``; empty:
#: that one), ``ACTIVE_OOM_KILLER`` (unset: on) and ``CUDA_TASK_PRIORITY`` (unset: 1).
CORE_POLICY = "GPU_CORE_UTILIZATION_POLICY"
DISABLE_CONTROL = "CUDA_DISABLE_CONTROL"
REDIRECT = "CUDA_REDIRECT"
OOM_KILLER = "ACTIVE_OOM_KILLER"
TASK_PRIORITY = "CUDA_TASK_PRIORITY"
NEUTRAL_SWITCHES: Mapping[str, str] = {
    CORE_POLICY: "default",
    DISABLE_CONTROL: "false",
    REDIRECT: "",
    OOM_KILLER: "true",
    TASK_PRIORITY: "1",
}


def memory_limit_env(index: int) -> str:
    """``CUDA_DEVICE_MEMORY_LIMIT_<index>``: the memory limit of device ``index``."""
    return f"CUDA_DEVICE_MEMORY_LIMIT_{index}"


def core_limit_env(index: int) -> str:
    """``CUDA_DEVICE_SM_LIMIT_<index>``: the core limit of device ``index`` (it outranks
    the un-indexed :data:`CORE_LIMIT`)."""
    return f"CUDA_DEVICE_SM_LIMIT_{index}"


@dataclass(frozen=True)
class Mount:
    container_path: str
    host_path: str
    read_only: bool


@dataclass(frozen=True)
class DeviceSpec:
    """A device node for the container (``ContainerAllocateResponse.devices``)."""

    container_path: str
    host_path: str
    permissions: str = "rw"


@dataclass(frozen=True)
class Hook:
    """An OCI hook for the container (a CDI ``containerEdits.hooks`` entry):
    ``hook_name`` is the OCI hook point (``createRuntime``, ``createContainer``, ...)."""

    hook_name: str
    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()


@dataclass(frozen=True)
class ContainerEdits:
    """The container edits of one grant (one ContainerAllocateResponse, or one CDI
    device of a claim), as plain data."""

    envs: dict[str, str] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)
    cdi_devices: list[str] = field(default_factory=list)  # fully qualified CDI names
    device_specs: list[DeviceSpec] = field(default_factory=list)
    #: OCI hooks (the driver memory hook, the limit check). The device-plugin API has no
    #: field for them: a door that carries them does so through CDI (``host/cdi.py``).
    hooks: list[Hook] = field(default_factory=list)


@dataclass(frozen=True)
class DriverHook:
    """The driver memory hook as the answers name it: the program installed on the host
    (``host/library.py``), and what every call of it adds after the card and the limit
    (the simulation's ``--nvml-lib``, a ``--cgroup-root`` other than the default) and its
    environment (the daemon's, never the tenant's: the simulated NVML's store)."""

    path: str
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()


#: The OCI hook point of the driver memory hook: after the container's cgroup exists and
#: holds its init process, before the user's program is executed.
CREATE_RUNTIME = "createRuntime"


@dataclass(frozen=True)
class Enforcement:
    """How limits reach the container: HAMi-core's interposer (``library`` None when
    running without it) and, per card, the backend of its memory and compute limits
    (``share/backendchoice.py``; a card not named has the interposer's)."""

    library: Path | None  # the versioned host file, e.g. /usr/local/vgpu/libvgpu.so.1a2b3c4d5e6f
    preload_file: Path | None  # host file listing CONTAINER_LIBRARY, for /etc/ld.so.preload
    use_ld_preload_env: bool
    # host directory mounted at LOCK_DIR (library.ensure_lock_dir); None: the host's LOCK_DIR
    lock_dir: Path | None = None
    #: card UUID -> its memory backend where that is not ``interposer`` (``driver``, ...)
    memory: Mapping[str, str] = field(default_factory=dict)
    #: card UUID -> its compute backend where that is not ``interposer`` (``none``, ...)
    compute: Mapping[str, str] = field(default_factory=dict)
    #: the hook that sets a ``driver`` card's limit; needed when a card is ``driver``
    driver_hook: DriverHook | None = None
    #: card UUID -> its total memory (MiB): the most a driver hook's limit may say (NVML
    #: refuses a limit above the card's total with INVALID_ARGUMENT)
    card_memory_mib: Mapping[str, int] = field(default_factory=dict)
    #: the same program installed on the host, run with ``--check-limits`` by every
    #: ``every_index`` share whose limits the interposer holds (:func:`limit_check`); None
    #: where it is not installed: such a share is refused (``container_edits`` raises)
    limit_check: str | None = None
    #: the MPS control daemon's own pipe directory (host), for cards whose compute is
    #: ``mps`` on a node without namespaces (every client shares it)
    mps_pipe: Path | None = None
    #: the host directory MPS servers and clients share as ``/dev/shm``
    mps_shm: Path | None = None

    def by_mps(self, uuid: str) -> bool:
        """The card's compute caps are MPS's (``share/backendchoice.py``)."""
        return self.compute.get(uuid) == "mps"

    def memory_soft(self, uuid: str) -> bool:
        """The card's memory limit is MPS's pinned limit (``soft``)."""
        return self.memory.get(uuid) == "soft"

    def by_driver(self, uuid: str) -> bool:
        """The card's memory limits are the driver's (set by :attr:`driver_hook`)."""
        return self.memory.get(uuid) == "driver"

    def interposer_counts_memory(self, uuid: str) -> bool:
        """HAMi-core counts this card's memory (it needs a cache directory per grant)."""
        return self.library is not None and self.memory.get(uuid, "interposer") == "interposer"

    def compute_by_interposer(self, uuid: str) -> bool:
        return self.compute.get(uuid, "interposer") == "interposer"

    def interposer_holds_a_limit(self, uuid: str) -> bool:
        """A share of this card has a limit the interposer holds (its memory or its
        compute): its container loads HAMi-core with limits from the env."""
        if self.library is None or self.by_mps(uuid):
            return False
        return not self.by_driver(uuid) or self.compute_by_interposer(uuid)


def driver_hook(
    enforcement: Enforcement, uuid: str, memory_mib: int, holder: Path | None = None
) -> Hook:
    """The createRuntime hook that sets card ``uuid``'s hard limit to ``memory_mib`` on
    the container's own cgroup: card and limit in the ARGUMENTS (a tenant writes its
    pod's env, never a hook's arguments). A limit above the card's total is held to the
    total: NVML would refuse it (INVALID_ARGUMENT) and the container would not start,
    though the card cannot give it more than all it has (the hook clamps the same way).
    ``holder``: a claim share's holder directory (``--holder``): the hook refuses a second
    live container of that share."""
    hook = enforcement.driver_hook
    if hook is None:
        raise ValueError(f"card {uuid} is enforced by the driver, but no hook is installed")
    memory_mib = min(memory_mib, enforcement.card_memory_mib.get(uuid, memory_mib))
    held = ("--holder", str(holder)) if holder is not None else ()
    args = (Path(hook.path).name, "--gpu", uuid, "--limit-mib", str(memory_mib), *held)
    args += hook.args
    return Hook(CREATE_RUNTIME, hook.path, args, hook.env)


def limit_check(enforcement: Enforcement, memory_mib: int | None, cores: int | None) -> Hook:
    """The createRuntime hook that refuses the container when its final env (the bundle's
    ``config.json``) lets HAMi-core give any card index more than ``memory_mib`` MiB or
    ``cores`` % (None: that limit is not this share's to hold), or leaves a switch of
    :data:`NEUTRAL_SWITCHES` at another value. An ``every_index`` share sets every index:
    in a container that uses two claims the runtime applies one spec's values last, and
    the smaller claim's check then sees the larger share (docs/dra.md, issue 32 item 2)."""
    path = enforcement.limit_check
    if path is None:
        raise ValueError(
            "the limit check (the memory hook, --memory-hook) is not installed on this "
            "node: a claim's share could not be held against a larger one in its container"
        )
    args = [Path(path).name, "--check-limits"]
    if memory_mib is not None:
        args += ["--memory-mib", str(memory_mib)]
    if cores is not None:
        args += ["--cores", str(cores)]
    for name, value in NEUTRAL_SWITCHES.items():
        args += ["--neutral", f"{name}={value}"]
    return Hook(CREATE_RUNTIME, path, tuple(args))


def lock_mount(enforcement: Enforcement) -> Mount:
    """HAMi-core's lock directory, shared by every container with the interposer."""
    return Mount(LOCK_DIR, str(enforcement.lock_dir or LOCK_DIR), read_only=False)


# --------------------------------------------------------------------------- grants


@dataclass(frozen=True)
class GrantedDevice:
    """One device of a grant: a card (its UUID) or a MIG device (``MIG-...``)."""

    id: str
    memory_mib: int = 0  # the device's whole memory: a whole grant's limit under enforcement
    #: its CDI device part where that is not ``id`` (the ``index`` name strategy); None: ``id``
    cdi_id: str | None = None
    #: device nodes the container needs (host and container paths alike; MIG capabilities)
    nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Grant:
    """What one container (or one claim's result) gets: the port's input.

    ``whole``: the devices go whole to the container; ``enforcement`` None then hands
    the raw devices (MIG, or whole cards without ``exclusiveEnforcement``). A share
    (``whole`` False) is of one card: ``memory_mib`` and ``cores`` are the limits to
    enforce, ``None`` leaves that limit out of this answer (a device-plugin Allocate
    carries one resource at a time, the kubelet merges the two answers; a DRA claim
    carries both at once); ``cache_dir`` is the container's (or claim's) host cache
    directory, mounted with a memory limit. Build one with :func:`share` or
    :func:`whole`."""

    devices: tuple[GrantedDevice, ...]
    whole: bool = False
    memory_mib: int | None = None
    cores: int | None = None
    enforcement: Enforcement | None = None
    cache_dir: Path | None = None
    #: the container's own MPS namespace pipe directory (host), capped before it starts;
    #: None on a node without namespaces (the control daemon's shared one is mounted)
    mps_pipe: Path | None = None
    #: A share whose container may see other cards beside this one (a DRA claim on
    #: several cards): the memory and core limits are set for every index HAMi-core
    #: reads too (it limits by the index a card has inside the container, which one
    #: result cannot know, and the container's own env is not checked against the
    #: reserved names), with its switches at their neutral values, and
    #: ``companions`` (the other cards, all of them in the node's order with this one)
    #: are named in ``NVIDIA_VISIBLE_DEVICES`` so that whichever result's edits the
    #: runtime applies last, every card stays visible and limited.
    every_index: bool = False
    companions: tuple[str, ...] = ()
    #: An ``every_index`` share's charge, (MiB, cores or None), where its limits were held
    #: below it (a DRA claim held to the smallest share of its containers): the most its
    #: limit check lets any card index of the container have. None: its own limits.
    charged: tuple[int, int | None] | None = None
    #: A DRA claim's share of a ``driver`` card: the host directory where the memory hook
    #: records the one live container holding it (``host/claimholders.py``), passed as
    #: its ``--holder``. None: every container sets its own limit (a device-plugin grant).
    holder: Path | None = None

    @property
    def ids(self) -> list[str]:
        return [d.id for d in self.devices]


def share(
    uuid: str,
    *,
    enforcement: Enforcement,
    memory_mib: int | None = None,
    cores: int | None = None,
    cache_dir: Path | None = None,
    cdi_id: str | None = None,
    mps_pipe: Path | None = None,
    every_index: bool = False,
    companions: Sequence[str] = (),
    charged: tuple[int, int | None] | None = None,
) -> Grant:
    """A share of card ``uuid``: these limits, enforced as ``enforcement`` says
    (``every_index``, ``companions``, ``charged``: see :class:`Grant`)."""
    return Grant(
        (GrantedDevice(uuid, cdi_id=cdi_id),),
        memory_mib=memory_mib,
        cores=cores,
        enforcement=enforcement,
        cache_dir=cache_dir,
        mps_pipe=mps_pipe,
        every_index=every_index,
        companions=tuple(companions),
        charged=charged,
    )


def whole(devices: Iterable[GrantedDevice], *, enforcement: Enforcement | None = None) -> Grant:
    """``devices`` whole, in the order the container sees them; with ``enforcement``
    the interposer with 100 % limits."""
    return Grant(tuple(devices), whole=True, enforcement=enforcement)


def container_edits(grant: Grant, listing: DeviceListing | None = None) -> ContainerEdits:
    """The edits of ``grant``: the port every front door calls.

    With ``listing`` the devices are named as the device-list strategy says (the
    ``NVIDIA_VISIBLE_DEVICES`` list and/or CDI names); without it they are named by
    ``NVIDIA_VISIBLE_DEVICES`` alone."""
    ids = grant.ids
    envs = {VISIBLE_DEVICES: ",".join(grant.companions or ids)}
    mounts: list[Mount] = []
    annotations: dict[str, str] = {}
    hooks: list[Hook] = []
    enforcement = grant.enforcement
    if grant.whole:
        if enforcement is not None and enforcement.library is not None:
            mounts = _interposer(envs, enforcement)
            for i, device in enumerate(grant.devices):
                envs[memory_limit_env(i)] = f"{device.memory_mib}m"
            envs[CORE_LIMIT] = "100"
    else:
        if len(grant.devices) != 1 or enforcement is None:
            raise ValueError("a share is of exactly one card, with its enforcement")
        uuid = grant.devices[0].id
        by_driver = enforcement.by_driver(uuid)
        if enforcement.by_mps(uuid):
            return _finish(grant, listing, *_mps_edits(grant, enforcement, uuid))
        compute_capped = enforcement.compute_by_interposer(uuid)
        if grant.memory_mib is not None:
            if by_driver:  # the driver's limit, set by the hook: nothing for libvgpu
                hooks.append(driver_hook(enforcement, uuid, grant.memory_mib, grant.holder))
            else:
                envs[MEMORY_LIMIT] = f"{grant.memory_mib}m"
                if grant.every_index:
                    envs[MEMORY_LIMIT_EVERY_INDEX] = f"{grant.memory_mib}m"
        if grant.cores is not None and (compute_capped or enforcement.library is None):
            envs[CORE_LIMIT] = str(grant.cores)
        if enforcement.library is None:
            if not by_driver:
                annotations[ANNOTATION_NO_ENFORCEMENT] = (
                    "disabled: gpushare runs with --no-enforcement, limits are advisory"
                )
        elif enforcement.interposer_holds_a_limit(uuid):
            mounts = _interposer(envs, enforcement)
            if grant.every_index:
                _seal_every_index(envs)
                hooks.append(_limit_check_of(grant, enforcement, uuid))
            if grant.memory_mib is not None and grant.cache_dir is not None and not by_driver:
                envs[SHARED_CACHE] = CONTAINER_CACHE_FILE
                mounts.append(Mount(CONTAINER_CACHE_DIR, str(grant.cache_dir), read_only=False))
    return _finish(grant, listing, envs, mounts, annotations, hooks)


def _finish(
    grant: Grant,
    listing: DeviceListing | None,
    envs: dict[str, str],
    mounts: list[Mount],
    annotations: dict[str, str],
    hooks: list[Hook],
) -> ContainerEdits:
    """The answer with the grant's device nodes, its devices named as ``listing`` says."""
    ids = grant.ids
    nodes: list[str] = []
    for device in grant.devices:
        nodes.extend(n for n in device.nodes if n not in nodes)
    answer = ContainerEdits(
        envs, mounts, annotations, device_specs=[DeviceSpec(n, n) for n in nodes], hooks=hooks
    )
    if listing is None:
        return answer
    cdi_ids = [d.cdi_id or d.id for d in grant.devices]
    answer = with_device_list(answer, ids, listing, cdi_ids if cdi_ids != ids else None)
    if grant.companions and ENVVAR in listing.strategies:
        answer.envs[VISIBLE_DEVICES] = ",".join(grant.companions)
    return answer


def _mps_edits(
    grant: Grant, enforcement: Enforcement, uuid: str
) -> tuple[dict[str, str], list[Mount], dict[str, str], list[Hook]]:
    """A share of a card whose compute is MPS's; no interposer is loaded.

    The memory answer (every shared container has one: core without memory is refused)
    carries the pipe directory: the container's own namespace (capped by the daemon
    before this answer left) or, without namespaces, the control daemon's. The core
    answer carries the client's thread cap, which a client can only lower (without
    namespaces it is all there is: ``soft``). Memory is the driver's hook where the card
    has it, otherwise MPS's pinned limit (``soft``: a client can drop it)."""
    envs = {VISIBLE_DEVICES: ",".join(grant.companions or (uuid,))}
    mounts: list[Mount] = []
    hooks: list[Hook] = []
    if grant.memory_mib is not None:
        pipe = grant.mps_pipe or enforcement.mps_pipe
        if pipe is None:
            raise ValueError(f"card {uuid} is shared through MPS, but no pipe directory is set")
        envs[MPS_PIPE] = CONTAINER_MPS_PIPE
        # read-only: a client connects to the sockets there (a connect needs no writable
        # mount); the root daemon and server write there, so a tenant must not be able
        # to plant a link or FIFO for them to follow (docs/security.md)
        mounts.append(Mount(CONTAINER_MPS_PIPE, str(pipe), read_only=True))
        if enforcement.mps_shm is not None:
            mounts.append(Mount(CONTAINER_SHM, str(enforcement.mps_shm), read_only=False))
        if enforcement.by_driver(uuid):
            hooks.append(driver_hook(enforcement, uuid, grant.memory_mib, grant.holder))
        else:
            envs[MPS_PINNED_MEMORY] = f"0={grant.memory_mib}M"
    if grant.cores is not None:
        envs[MPS_THREADS] = str(min(max(grant.cores, 1), 100))
    return envs, mounts, {}, hooks


def _seal_every_index(envs: dict[str, str]) -> None:
    """An ``every_index`` grant's limits under every name HAMi-core reads for them.

    Its container's env is not checked against the reserved names (the admission policy
    cannot tell a gpushare claim from another driver's), and its CDI spec replaces only
    the names it sets: so it sets each limit it holds for every index HAMi-core reads
    (:data:`INTERPOSER_INDEXES`), and HAMi-core's switches to the values that behave as
    if unset (:data:`NEUTRAL_SWITCHES`), so no name the tenant's
    env sets survives to redirect, reprioritise or disable them (docs/security.md)."""
    memory, cores = envs.get(MEMORY_LIMIT), envs.get(CORE_LIMIT)
    for i in range(INTERPOSER_INDEXES):
        if memory is not None:
            envs[memory_limit_env(i)] = memory
        if cores is not None:
            envs[core_limit_env(i)] = cores
    envs.update(NEUTRAL_SWITCHES)


def _limit_check_of(grant: Grant, enforcement: Enforcement, uuid: str) -> Hook:
    """The limit check of an ``every_index`` share of card ``uuid``: at most its charge
    (:attr:`Grant.charged`, else its own limits) on every index, for each limit the
    interposer holds; cores only where a limit below 100 % is set."""
    memory, cores = grant.charged or (grant.memory_mib, grant.cores)
    if grant.memory_mib is None or enforcement.by_driver(uuid):
        memory = None
    capped = grant.cores is not None and enforcement.compute_by_interposer(uuid)
    if not capped or cores is None or not 0 < cores < 100:
        cores = None
    return limit_check(enforcement, memory, cores)


def _interposer(envs: dict[str, str], enforcement: Enforcement) -> list[Mount]:
    """The interposer's mounts (library, lock directory, preload file), its
    ``LD_PRELOAD`` added to ``envs``."""
    mounts = [
        Mount(CONTAINER_LIBRARY, str(enforcement.library), read_only=True),
        lock_mount(enforcement),
    ]
    if enforcement.use_ld_preload_env:
        envs[PRELOAD] = CONTAINER_LIBRARY
    if enforcement.preload_file is not None:
        mounts.append(Mount(LD_SO_PRELOAD, str(enforcement.preload_file), read_only=True))
    return mounts


# --------------------------------------------------------------------------- device lists

ENVVAR = "envvar"
CDI_CRI = "cdi-cri"
CDI_ANNOTATIONS = "cdi-annotations"
DEVICE_LIST_STRATEGIES = (ENVVAR, CDI_CRI, CDI_ANNOTATIONS)
CDI_ANNOTATION_PREFIX = "cdi.k8s.io/"
#: What the NVIDIA container toolkit reads as "no GPU": set when the envvar strategy is
#: off, so an image's own ``NVIDIA_VISIBLE_DEVICES=all`` cannot expose every card.
NO_DEVICES = "void"


@dataclass(frozen=True)
class DeviceListing:
    """How an answer names its devices to the container runtime (``--device-list-strategy``).

    ``strategies`` is a subset of :data:`DEVICE_LIST_STRATEGIES`, combinable:
    ``envvar`` sets ``NVIDIA_VISIBLE_DEVICES`` (the NVIDIA runtime reads it),
    ``cdi-cri`` fills ``ContainerAllocateResponse.cdi_devices`` (kubelet >= 1.31),
    ``cdi-annotations`` adds ``cdi.k8s.io/<plugin>_<first id>: <names>``.
    """

    strategies: frozenset[str] = frozenset({ENVVAR})
    cdi_kind: str = "nvidia.com/gpu"  # <vendor>/<class> of the CDI names
    annotation_plugin: str = "gpushare"  # the <plugin> part of the annotation key
    #: device ID -> its CDI device name where that differs (the "index" name strategy)
    cdi_ids: Mapping[str, str] = field(default_factory=dict)

    @property
    def uses_cdi(self) -> bool:
        return bool(self.strategies & {CDI_CRI, CDI_ANNOTATIONS})

    def cdi_name(self, device: str) -> str:
        """``nvidia.com/gpu=GPU-...``: a fully qualified CDI device name."""
        return f"{self.cdi_kind}={self.cdi_ids.get(device, device)}"

    def annotation_key(self, first_device: str) -> str:
        """``cdi.k8s.io/<plugin>_<device>``, '/' replaced by '_', name part <= 63 chars."""
        name = f"{self.annotation_plugin}_{first_device.replace('/', '_')}"
        return CDI_ANNOTATION_PREFIX + name[:63].rstrip("-_.")


def with_device_list(
    answer: ContainerEdits,
    devices: Sequence[str],
    listing: DeviceListing,
    cdi_devices: Sequence[str] | None = None,
) -> ContainerEdits:
    """``answer`` naming ``devices`` as ``listing`` says. Pure.

    ``cdi_devices`` are the CDI device parts to use (default: ``devices``; the
    ``index`` name strategy passes card indexes instead of UUIDs). Everything else of
    the answer (limits, interposer mounts) stays as it is.
    """
    envs = dict(answer.envs)
    annotations = dict(answer.annotations)
    names = [listing.cdi_name(d) for d in (devices if cdi_devices is None else cdi_devices)]
    if ENVVAR in listing.strategies:
        envs[VISIBLE_DEVICES] = ",".join(devices)
    else:
        envs[VISIBLE_DEVICES] = NO_DEVICES
    cdi = names if CDI_CRI in listing.strategies else []
    if CDI_ANNOTATIONS in listing.strategies and devices:
        annotations[listing.annotation_key(devices[0])] = ",".join(names)
    return replace(answer, envs=envs, annotations=annotations, cdi_devices=cdi)


# --------------------------------------------------------------------------- sealed grants


def sealed(edits: ContainerEdits, grant_cdi_name: str, listing: DeviceListing) -> ContainerEdits:
    """The kubelet's answer for ``edits`` that ride on the daemon's own CDI device
    ``grant_cdi_name`` (``<vendor>/<class>=<name>``; the spec is written by
    ``host/grantspecs.py``): no environment and no mounts of its own, the card's CDI
    names with ours last (the runtime applies the devices in turn: ours replaces any
    variable an earlier one set), and the device nodes as they were.

    The runtime applies CDI edits after the container's own env and mounts from the
    pod spec and replaces what they set (env by name, a mount by its container path),
    so nothing a tenant writes in its pod spec can change these limits (issue 32)."""
    if not listing.uses_cdi:
        raise ValueError("sealing needs a CDI device-list strategy")
    cdi = [*edits.cdi_devices, grant_cdi_name] if CDI_CRI in listing.strategies else []
    annotations = {k: v for k, v in edits.annotations.items() if k != ANNOTATION_NO_ENFORCEMENT}
    if CDI_ANNOTATIONS in listing.strategies:
        for key, names in edits.annotations.items():
            if key.startswith(CDI_ANNOTATION_PREFIX):
                annotations[key] = f"{names},{grant_cdi_name}"
    if ANNOTATION_NO_ENFORCEMENT in edits.annotations:
        annotations[ANNOTATION_NO_ENFORCEMENT] = edits.annotations[ANNOTATION_NO_ENFORCEMENT]
    return ContainerEdits(
        annotations=annotations,
        cdi_devices=cdi,
        device_specs=list(edits.device_specs),
    )
