"""A stand-in kubelet that drives a device plugin the way the real one does.

It imitates the kubelet's device manager (``pkg/kubelet/cm/devicemanager``, v1.32) in
everything a plugin can observe:

* **Registration.** It serves ``Registration`` on ``<dir>/kubelet.sock`` and, on
  Register, dials the plugin back, asks for its options and keeps a ListAndWatch
  stream open; each message replaces the resource's device set, and a stream that
  ends marks every device of the resource unhealthy (no redial).
* **Admission** (``allocateContainerResources``). Pods one at a time, their containers
  in spec order (init containers first). Per container, the resources come in the
  iteration order of a Go map of its limits: the listing order about 7 times in 8,
  another order otherwise (seedable, ``seed``). Per resource: the free healthy
  devices are offered to GetPreferredAllocation (when the plugin advertises it), the
  answer is honoured only within them and padded when short, then one Allocate; as
  soon as it returns, the allocation is recorded (``podDevices.insert``) and visible
  to PodResources before the next resource is asked for. Devices of ordinary init
  containers are handed on to the later containers of the pod (``devicesToReuse``):
  a container fully covered by them gets no GetPreferredAllocation, one partly
  covered gets them as ``must_include_deviceIDs``.
* **Rejection.** An Allocate error or too few free devices fails the whole pod. The
  kubelet frees a rejected pod's devices in ``UpdateAllocatedDevices``, which runs
  before the next admission allocates anything and at the start of every PodResources
  ``List``: no plugin can observe them in between, so they are freed at once here.
* **Pods ending mid-admission** (:meth:`SimulatedKubelet.end`). The kubelet frees
  an ended pod's devices in ``UpdateAllocatedDevices``, which runs at the start of
  each container's allocation and at the start of every PodResources ``List``: a pod
  whose termination completes while a container is being admitted (a kubelet that
  has just restarted and is still killing deleted pods) is counted in the offer of
  that container's first resource and freed by the plugin's own ``List`` before its
  second resource is offered.
* **PodResources** (``server_v1.go``). ``List`` shows active pods only, their app
  containers and restartable init containers (not ordinary init containers), and is
  rate-limited like the kubelet's (``ResourceExhausted`` beyond ``list_rate`` per
  second, burst ``list_burst``).
* **Restart.** Every plugin stream ends, every socket in the directory is removed, and
  the new ``kubelet.sock`` replaces the old one atomically (bound at a temporary path
  and renamed over it), so the socket file never goes missing.

Answers are merged as the kubelet merges them (the first value of an env key or mount
path wins, conflicts are recorded). Used by the demo, the tests and the benchmark;
operators can use it to try a configuration without a cluster.
"""

from __future__ import annotations

import copy
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from gpushare._proto.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from gpushare._proto.podresources.v1 import api_pb2 as pr_pb2
from gpushare._proto.podresources.v1 import api_pb2_grpc as pr_pb2_grpc

DIAL_TIMEOUT = 10.0
#: The kubelet sets no deadline on GetPreferredAllocation and Allocate (v1.36
#: ``ManagerImpl.Allocate`` passes ``context.TODO()``): a plugin may take its time. The
#: stand-in bounds them only so a wedged plugin fails a test instead of hanging it,
#: far past any wait of the daemon's own (``binding.RECORDS_WAIT``).
ADMISSION_CALL_TIMEOUT = 120.0
#: The kubelet's PodResources limit (``podresources.DefaultQPS``/``DefaultBurstTokens``).
LIST_RATE = 100.0
LIST_BURST = 10

#: Called after each admission RPC with (resource, method, seconds); the benchmark times calls.
CallObserver = Callable[[str, str, float], None]


class AdmissionError(Exception):
    """The container was not admitted: ``Insufficient`` or an Allocate error."""

    def __init__(self, reason: str, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.code = code


@dataclass
class Endpoint:
    """One registered resource: its channel, options and the latest device list."""

    resource: str
    socket: Path | None
    channel: grpc.Channel | None
    stub: Any  # api_pb2_grpc.DevicePluginStub, or anything with the same unary methods
    options: Any
    devices: dict[str, Any] = field(default_factory=dict)  # ID -> Device, in order
    healthy: list[str] = field(default_factory=list)  # IDs of the healthy devices, in order
    updates: int = 0
    stream: Any = None
    #: the kubelet dropped its record of this client (a refused second registration of
    #: its path): its stream ending no longer frees the path
    orphaned: bool = False
    ended: bool = False  # its ListAndWatch stream ended


@dataclass
class Admitted:
    """What the container runtime would be told for one admitted container."""

    pod: str
    container: str
    namespace: str
    devices: dict[str, list[str]]  # resource -> device IDs
    envs: dict[str, str]
    mounts: dict[str, Any]  # container path -> Mount
    annotations: dict[str, str]
    responses: dict[str, Any]  # resource -> ContainerAllocateResponse
    conflicts: list[str]
    init: bool = False  # an ordinary init container: not listed by PodResources
    restartable: bool = False  # a sidecar (init container with restartPolicy Always)

    def card(self) -> str:
        return self.envs.get("NVIDIA_VISIBLE_DEVICES", "")


@dataclass(frozen=True)
class ContainerSpec:
    """One container of a pod as the kubelet admits it."""

    name: str
    requests: Mapping[str, int]
    init: bool = False
    restartable: bool = False  # an init container with ``restartPolicy: Always``


class PluginRegistry(api_pb2_grpc.RegistrationServicer):
    """The kubelet's device-manager side of registration: ``Register`` dials the plugin
    back, each resource's ListAndWatch stream keeps its device list, and a stream that
    ends marks the resource's devices unhealthy, as the kubelet does.

    ``version`` picks how a second endpoint of a resource is handled (read in v1.37.2's
    ``devicemanager``; v1.36's in kubernetes#121994 and #135437):

    * **1.37 on**: endpoints are held by (resource, socket path) until their stream ends.
      A registration makes the new endpoint the resource's own at once and leaves the
      old one running; when a stream ends, another endpoint still held is promoted and
      nothing is marked unhealthy, and only the last one's end marks the devices
      unhealthy. A registration of a held path is refused ("device plugin already
      connected: <path>") and the refusal drops the kubelet's record of the holding
      client, so the path stays refused until this kubelet restarts (seen on v1.37.2,
      docs/restarts.md).
    * **1.36**: one client per resource. A registration replaces the endpoint; when any
      of the resource's streams ends, the kubelet disconnects the resource's current
      client (a newer one too: its stream is closed) and marks the devices unhealthy.

    :attr:`unserved_at_registration` notes each registration that found the resource's
    current endpoint not serving (its stream ended, or its server not answering): an
    admission at that moment would have failed."""

    def __init__(self, plugin_dir: Path, version: str = "v1.37.2") -> None:
        self.plugin_dir = Path(plugin_dir)
        self.version = version
        minor = version.removeprefix("v").split(".")[:2]
        #: endpoints keyed by socket path (1.37 on)
        self.by_path = tuple(int(x) for x in minor) >= (1, 37)
        #: 1.36: the one client per resource
        self.clients: dict[str, Endpoint] = {}
        self.unserved_at_registration: list[tuple[str, str]] = []
        #: 1.36: newer clients disconnected by an older stream's end
        self.newer_disconnected = 0
        self.watch_delay = 0.0  # seconds between a registration and its ListAndWatch
        self.endpoints: dict[str, Endpoint] = {}
        self.registrations: list[tuple[str, str]] = []  # (resource, endpoint)
        #: (resource, socket path) -> the endpoint holding it (1.37's endpoint store)
        self.held: dict[tuple[str, Path], Endpoint] = {}
        self.refused: list[tuple[str, str]] = []  # (resource, endpoint) refused as held
        #: which run of this kubelet serves now (one more at each stop): a Register taken
        #: by a run that has stopped since never reaches the next run's state
        self.generation = 0
        #: registrations dropped because their kubelet run stopped while they dialled back
        self.stale_registrations = 0
        self._lock = threading.Condition()

    # ---------------------------------------------------------------- Registration
    def Register(
        self, request: api_pb2.RegisterRequest, context: grpc.ServicerContext
    ) -> api_pb2.Empty:
        if request.version != "v1beta1":
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"unsupported version {request.version}"
            )
        if "/" in request.endpoint or not request.endpoint:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "endpoint must be a socket file name")
        socket = self.plugin_dir / request.endpoint
        with self._lock:
            generation = self.generation
        channel = grpc.insecure_channel(f"unix://{socket}")
        try:
            grpc.channel_ready_future(channel).result(timeout=DIAL_TIMEOUT)
            stub = api_pb2_grpc.DevicePluginStub(channel)
            options = stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=DIAL_TIMEOUT)
        except (grpc.FutureTimeoutError, grpc.RpcError) as exc:
            channel.close()
            context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot dial plugin: {exc}")
        endpoint = Endpoint(request.resource_name, socket, channel, stub, options)
        key = (request.resource_name, socket)
        self._note_serving(request.resource_name, socket)
        with self._lock:  # the check and the taking of the path in one step
            stale = generation != self.generation
            holder = self.held.get(key) if self.by_path and not stale else None
            if stale:
                # The real kubelet that took this call is gone with its process: nothing
                # it was doing reaches the restarted one (the plugin registers again).
                self.stale_registrations += 1
            elif holder is not None:
                holder.orphaned = True
                self.refused.append((request.resource_name, request.endpoint))
            else:
                # The kubelet keeps a resource's devices per resource, not per endpoint: a
                # newer endpoint is given them until its own ListAndWatch says otherwise
                # (the count never reads 0 between its registration and its first message).
                previous = self.endpoints.get(request.resource_name)
                if previous is not None and previous.devices:
                    endpoint.devices = copy.deepcopy(previous.devices)
                    endpoint.healthy = list(previous.healthy)
                self.endpoints[request.resource_name] = endpoint
                self.held[key] = endpoint
                self.clients[request.resource_name] = endpoint
                self.registrations.append((request.resource_name, request.endpoint))
            self._lock.notify_all()  # a registration is a change wait_for looks at
        if stale:
            channel.close()
            context.abort(grpc.StatusCode.UNAVAILABLE, "the kubelet restarted meanwhile")
        if holder is not None:
            channel.close()
            context.abort(grpc.StatusCode.UNKNOWN, f"device plugin already connected: {socket}")
        threading.Thread(target=self._watch, args=(endpoint,), daemon=True).start()
        return api_pb2.Empty()

    def _note_serving(self, resource: str, socket: Path) -> None:
        """Note it when a registration finds the resource's current endpoint (another
        path) not serving: an admission now would fail."""
        with self._lock:
            current = self.endpoints.get(resource)
        if current is None or current.socket is None or current.socket == socket:
            return
        serving = not current.ended
        if serving:
            try:
                current.stub.GetDevicePluginOptions(api_pb2.Empty(), timeout=DIAL_TIMEOUT)
            except (grpc.RpcError, ValueError):
                serving = False
        if not serving:
            with self._lock:
                self.unserved_at_registration.append((resource, current.socket.name))

    def attach(self, resource: str, stub: Any, options: Any, devices: Iterable[Any]) -> None:
        """Register a plugin reached without a socket (an in-process stub with the same
        unary methods), with its device list: for exhaustive tests of admission
        sequences, where gRPC transport would only cost time."""
        endpoint = Endpoint(resource, None, None, stub, options)
        self._adopt(endpoint, devices)
        with self._lock:
            self.endpoints[resource] = endpoint

    def _adopt(self, endpoint: Endpoint, listed: Iterable[Any]) -> None:
        devices = {d.ID: d for d in listed}
        healthy = [i for i, d in devices.items() if d.health == "Healthy"]
        with self._lock:
            endpoint.devices = devices
            endpoint.healthy = healthy
            endpoint.updates += 1
            self._lock.notify_all()

    def _watch(self, endpoint: Endpoint) -> None:
        if self.watch_delay:
            time.sleep(self.watch_delay)  # a busy kubelet takes a moment to dial back
        try:
            endpoint.stream = endpoint.stub.ListAndWatch(api_pb2.Empty())
            for response in endpoint.stream:
                self._adopt(endpoint, response.devices)
        except grpc.RpcError:
            pass
        except ValueError:
            pass  # "Channel closed": the plugin registered again (or we stopped) meanwhile
        closing = None
        with self._lock:
            endpoint.ended = True
            if endpoint.socket is None or endpoint.orphaned:
                pass  # attached, or a client the kubelet no longer knows: nothing happens
            elif self.by_path:
                self._ended_by_path(endpoint)
            else:
                closing = self._ended_one_client(endpoint)
            self._lock.notify_all()
        if closing is not None:
            self._close(closing)

    def _ended_by_path(self, endpoint: Endpoint) -> None:
        """1.37's ``PluginDisconnected``: the path is free again; another endpoint of the
        resource still held is promoted, else the devices are marked unhealthy."""
        if (
            endpoint.socket is not None
            and self.held.get(key := (endpoint.resource, endpoint.socket)) is endpoint
        ):
            del self.held[key]
        remaining = [e for (r, _path), e in self.held.items() if r == endpoint.resource]
        if remaining:
            if self.endpoints.get(endpoint.resource) is endpoint:
                self.endpoints[endpoint.resource] = remaining[0]
        else:
            self._mark_unhealthy(endpoint.resource)

    def _ended_one_client(self, endpoint: Endpoint) -> Endpoint | None:
        """1.36's ``runClient`` after a stream ended: the resource's current client is
        disconnected, whichever it is (kubernetes#121994), and the devices marked
        unhealthy; the client to close (outside the lock), if any."""
        current = self.clients.pop(endpoint.resource, None)
        if current is None:
            return None  # its client was disconnected already: nothing happens
        self._mark_unhealthy(endpoint.resource)
        if current is endpoint:
            return None
        self.newer_disconnected += 1
        return current

    def _mark_unhealthy(self, resource: str) -> None:
        primary = self.endpoints.get(resource)
        if primary is not None:
            for device in primary.devices.values():
                device.health = "Unhealthy"
            primary.healthy = []

    @staticmethod
    def _close(endpoint: Endpoint) -> None:
        if endpoint.stream is not None:
            endpoint.stream.cancel()
        if endpoint.channel is not None:
            endpoint.channel.close()

    def wait_for(self, predicate: Any, timeout: float = 30.0) -> bool:
        """Wait until ``predicate(self)`` holds; re-checked on every plugin update."""
        with self._lock:
            return bool(self._lock.wait_for(lambda: predicate(self), timeout))

    def endpoint_socket(self, resource: str) -> Path | None:
        """The socket of the resource's current endpoint: where the kubelet dials the
        plugin (its registration's endpoint name); None while none is registered."""
        with self._lock:
            endpoint = self.endpoints.get(resource)
            return endpoint.socket if endpoint is not None else None

    def registered_names(self, resource: str) -> list[str]:
        """The endpoint names registered for ``resource``, in order."""
        with self._lock:
            return [name for r, name in self.registrations if r == resource]

    def devices(self, resource: str) -> dict[str, Any]:
        with self._lock:
            endpoint = self.endpoints.get(resource)
            return dict(endpoint.devices) if endpoint else {}

    def healthy_count(self, resource: str) -> int:
        return sum(1 for d in self.devices(resource).values() if d.health == "Healthy")


#: (namespace, pod, ((container, ((resource name, device IDs), ...)), ...))
_Listed = tuple[str, str, tuple[tuple[str, tuple[tuple[str, tuple[str, ...]], ...]], ...]]


def _pod_entry(listed: _Listed) -> bytes:
    """One pod's entry of a ``List`` answer (field 1 of the response, encoded)."""
    namespace, pod, containers = listed
    message = pr_pb2.ListPodResourcesResponse(
        pod_resources=[
            pr_pb2.PodResources(
                name=pod,
                namespace=namespace,
                containers=[
                    pr_pb2.ContainerResources(
                        name=container,
                        # one entry per device, each with its NUMA node (0 here), as the
                        # real kubelet (1.36) answers (e2e/README.md)
                        devices=[
                            pr_pb2.ContainerDevices(
                                resource_name=res,
                                device_ids=[device],
                                topology=pr_pb2.TopologyInfo(nodes=[pr_pb2.NUMANode(ID=0)]),
                            )
                            for res, ids in devices
                            for device in ids
                        ],
                    )
                    for container, devices in containers
                ],
            )
        ]
    )
    return message.SerializeToString()


class PodResourcesLister(pr_pb2_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources ``List``: active pods, app containers and sidecars
    only, rate-limited as the kubelet is (a token bucket)."""

    def __init__(self, list_rate: float, list_burst: int) -> None:
        self.admitted: dict[tuple[str, str, str], Admitted] = {}
        self._list_rate = list_rate
        self._list_burst = float(list_burst)
        self._list_tokens = float(list_burst)
        self._list_refilled = time.monotonic()
        self.list_refusals = 0
        self.lists_served = 0  # List calls answered (not refused)
        self.list_delay = 0.0  # seconds a List takes to answer (a busy kubelet)
        #: List calls taken and not answered until this is False again (a hung kubelet:
        #: the real one's PodResources server accepts calls it never answers)
        self.lists_hang = False
        self.lists_received = 0  # List calls taken past the rate limit
        #: the pods the kubelet's pod manager holds, which are all ``List`` looks at
        #: (None: every admitted pod). A restarted kubelet starts empty and adds each
        #: pod of its first batch just before admitting it (see :meth:`restart`).
        self.pod_manager: set[tuple[str, str]] | None = None
        self._lock = threading.Condition()
        #: each listed pod's encoded entry of the answer, by what it lists
        self._encoded: dict[_Listed, bytes] = {}
        #: pods that ended (:meth:`SimulatedKubelet.end`) -> the admissions started
        #: then; their devices are held until the next ``UpdateAllocatedDevices``
        self.ended: dict[tuple[str, str], int] = {}
        self.admissions_started = 0

    def update_allocated_devices(self, *, admission: bool) -> None:
        """Free the devices of ended pods: at a ``List``, those whose end came during an
        admission started since; at the start of a container's allocation, those that
        ended before the previous one began (a pod ending during an admission is still
        counted at its start)."""
        with self._lock:
            for (namespace, pod), started in list(self.ended.items()):
                if started >= self.admissions_started - (1 if admission else 0):
                    continue
                del self.ended[namespace, pod]
                for key in [k for k in self.admitted if k[:2] == (namespace, pod)]:
                    del self.admitted[key]

    def _take_list_token(self) -> bool:
        with self._lock:
            now = time.monotonic()
            self._list_tokens = min(
                self._list_burst, self._list_tokens + (now - self._list_refilled) * self._list_rate
            )
            self._list_refilled = now
            if self._list_tokens < 1.0:
                self.list_refusals += 1
                return False
            self._list_tokens -= 1.0
            return True

    def list_response(self) -> pr_pb2.ListPodResourcesResponse:
        """What ``List`` answers: active pods, app containers and sidecars only.

        Each pod's entry is encoded once and kept while what it lists is unchanged. The
        answer is the same; building all of it anew as protobuf's Python objects took
        ~10 ms for 1 000 entries (one per device), in the benchmark's own process and
        inside the daemon's timed GetPreferredAllocation, where the real kubelet builds
        it in compiled Go in a process of its own."""
        with self._lock:
            by_pod: dict[tuple[str, str], list[Admitted]] = {}
            known = self.pod_manager
            for record in self.admitted.values():
                if record.init:
                    continue  # ordinary init containers are not listed
                if known is not None and (record.namespace, record.pod) not in known:
                    continue  # not in the pod manager (yet): its devices are held, unlisted
                by_pod.setdefault((record.namespace, record.pod), []).append(record)
            kept = self._encoded
            encoded: dict[_Listed, bytes] = {}
            for (namespace, pod), records in by_pod.items():
                listed = (
                    namespace,
                    pod,
                    tuple(
                        (r.container, tuple((res, tuple(ids)) for res, ids in r.devices.items()))
                        for r in records
                    ),
                )
                encoded[listed] = kept.get(listed) or _pod_entry(listed)
            self._encoded = encoded
        answer = b"".join(encoded.values())
        return pr_pb2.ListPodResourcesResponse.FromString(answer)

    def List(
        self, request: pr_pb2.ListPodResourcesRequest, context: grpc.ServicerContext
    ) -> pr_pb2.ListPodResourcesResponse:
        if not self._take_list_token():
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "rate limit exceeded")
        with self._lock:
            self.lists_received += 1
            self._lock.wait_for(lambda: not self.lists_hang)
        if self.list_delay:
            time.sleep(self.list_delay)  # a slow kubelet, for tests of late records
        with self._lock:
            self.lists_served += 1
        self.update_allocated_devices(admission=False)
        return self.list_response()


def _merge(record: Admitted, response: api_pb2.ContainerAllocateResponse) -> None:
    """What the runtime makes of one resource's answer: its env, mounts and annotations
    added to the container's; an env or mount another resource's answer set otherwise
    is a conflict (kept first-come)."""
    for name, value in response.envs.items():
        if name in record.envs and record.envs[name] != value:
            record.conflicts.append(f"env {name}: {record.envs[name]} vs {value}")
            continue
        record.envs.setdefault(name, value)
    for mount in response.mounts:
        old = record.mounts.get(mount.container_path)
        if old is not None and old.host_path != mount.host_path:
            record.conflicts.append(f"mount {mount.container_path}")
            continue
        record.mounts.setdefault(mount.container_path, mount)
    record.annotations.update(response.annotations)


class SimulatedKubelet(PluginRegistry, PodResourcesLister):
    """A kubelet's device manager and PodResources server, over real sockets: plugins
    register and stream their devices (:class:`PluginRegistry`), containers are admitted
    in the kubelet's order and call sequence, and the records are listed
    (:class:`PodResourcesLister`)."""

    def __init__(
        self,
        plugin_dir: Path,
        pod_resources_socket: Path | None = None,
        observe: CallObserver | None = None,
        *,
        seed: int | None = 0,
        list_rate: float = LIST_RATE,
        list_burst: int = LIST_BURST,
        version: str = "v1.37.2",
    ) -> None:
        PodResourcesLister.__init__(self, list_rate, list_burst)
        # its lock is the one both sides share
        PluginRegistry.__init__(self, plugin_dir, version)
        self.pod_resources_socket = pod_resources_socket
        self.observe = observe
        self.rng = random.Random(seed)
        #: Per container: the resource order the kubelet used, for tests to look at.
        self.orders: list[tuple[str, list[str]]] = []
        self._reuse: dict[tuple[str, str], dict[str, list[str]]] = {}  # pod -> reusable
        self._server: Any = None
        self._pr_server: Any = None

    # ---------------------------------------------------------------- lifecycle
    @property
    def socket(self) -> Path:
        return self.plugin_dir / "kubelet.sock"

    def start(self) -> None:
        """Listen on ``kubelet.sock``: bound at a temporary path and renamed over the
        old socket file, so that ``kubelet.sock`` never goes missing."""
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        temporary = self.plugin_dir / f".kubelet-{os.getpid()}-{id(self):x}.sock"
        temporary.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        api_pb2_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix://{temporary}")
        server.start()
        os.rename(temporary, self.socket)
        self._server = server
        if self.pod_resources_socket is not None and self._pr_server is None:
            self.pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
            self.pod_resources_socket.unlink(missing_ok=True)
            pr_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
            pr_pb2_grpc.add_PodResourcesListerServicer_to_server(self, pr_server)
            pr_server.add_insecure_port(f"unix://{self.pod_resources_socket}")
            pr_server.start()
            self._pr_server = pr_server

    def hang_lists(self, hang: bool) -> None:
        """Make ``List`` take calls and never answer them (until called with False)."""
        with self._lock:
            self.lists_hang = hang
            self._lock.notify_all()

    def stop(self, *, keep_pod_resources: bool = False) -> None:
        if not keep_pod_resources:
            self.hang_lists(False)  # a handler thread must not outlive the server
        with self._lock:
            self.generation += 1
            known = [*self.endpoints.values(), *self.held.values()]
            endpoints = list({id(e): e for e in known}.values())
            for endpoint in endpoints:
                endpoint.orphaned = True  # this kubelet is gone: its streams' ends mean nothing
            self.endpoints.clear()
            self.held.clear()
            self.clients.clear()
        for endpoint in endpoints:
            self._close(endpoint)
        if self._server is not None:
            self._server.stop(0).wait()
            self._server = None
        if self._pr_server is not None and not keep_pod_resources:
            self._pr_server.stop(0).wait()
            self._pr_server = None

    def restart(self, *, remove_sockets: bool = True, empty_pod_manager: bool = False) -> None:
        """What a kubelet restart does: drop every plugin, delete every other socket in
        the directory, and replace ``kubelet.sock`` atomically.

        Allocations survive, as they do in the kubelet's checkpoint. With
        ``remove_sockets=False`` the plugins' sockets stay (the kubelet only logs a
        failure to clean its directory), so only the new ``kubelet.sock`` tells.
        ``empty_pod_manager``: the restarted kubelet's first batch of pods is still
        being admitted: ``List`` shows only the pods admitted since (the real 1.36
        kubelet adds each pod to its pod manager just before admitting it, ordering
        the batch by creation time, to the second), until :meth:`pods_synced`.
        """
        with self._lock:
            self.pod_manager = set() if empty_pod_manager else None
        self.stop(keep_pod_resources=True)
        for path in self.plugin_dir.glob("*.sock"):
            if path != self.socket and remove_sockets:
                path.unlink(missing_ok=True)
        self.start()

    def pods_synced(self) -> None:
        """Every admitted pod is in the pod manager again (the first batch is done)."""
        with self._lock:
            self.pod_manager = None

    def allocated(self, resource: str) -> set[str]:
        with self._lock:
            return {d for a in self.admitted.values() for d in a.devices.get(resource, ())}

    def go_map_order(self, resources: Sequence[str]) -> list[str]:
        """The order a Go map of these limits iterates in: the listing order about 7
        times in 8 (a small map mostly iterates in insertion order), another otherwise."""
        order = list(resources)
        if len(order) > 1 and self.rng.random() < 1 / 8:
            while order == list(resources):
                self.rng.shuffle(order)
        return order

    # ---------------------------------------------------------------- admission
    def admit(
        self,
        pod: str,
        container: str,
        requests: Mapping[str, int],
        *,
        namespace: str = "default",
        order: Sequence[str] | None = None,
        init: bool = False,
        restartable: bool = False,
    ) -> Admitted:
        """Admit one container asking ``requests`` (resource name -> units).

        ``order`` fixes the order of its resources; by default it is a Go map's. On
        failure the whole pod is rejected: every container of it admitted so far
        gives its devices back.
        """
        resources = [r for r in requests if requests[r] > 0]
        order = list(order) if order is not None else self.go_map_order(resources)
        self.orders.append((container, order))
        record = Admitted(pod, container, namespace, {}, {}, {}, {}, {}, [])
        record.init, record.restartable = init and not restartable, restartable
        key = (namespace, pod, container)
        reusable = self._reuse.setdefault((namespace, pod), {})
        for other in list(self._reuse):
            if other != (namespace, pod):
                del self._reuse[other]  # devicesToReuse keeps the pod being admitted only
        with self._lock:
            self.admissions_started += 1
        self.update_allocated_devices(admission=True)
        with self._lock:
            if self.pod_manager is not None:
                self.pod_manager.add((namespace, pod))  # AddPod, then admission
        try:
            for resource in order:
                self._allocate_one(record, resource, requests[resource], reusable.get(resource))
                with self._lock:
                    self.admitted[key] = record  # visible to PodResources as it grows
        except AdmissionError:
            self._reject(namespace, pod)
            raise
        for resource, ids in record.devices.items():
            pool = reusable.setdefault(resource, [])
            if record.init and not record.restartable:
                pool.extend(d for d in ids if d not in pool)  # handed on to later containers
            else:
                reusable[resource] = [d for d in pool if d not in ids]
        return record

    def admit_pod(
        self, pod: str, containers: Sequence[ContainerSpec], *, namespace: str = "default"
    ) -> list[Admitted]:
        """Admit a whole pod: init containers first, then app containers, in spec order."""
        ordered = [c for c in containers if c.init] + [c for c in containers if not c.init]
        return [
            self.admit(
                pod,
                c.name,
                c.requests,
                namespace=namespace,
                init=c.init,
                restartable=c.restartable,
            )
            for c in ordered
            if any(c.requests.values())
        ]

    def _reject(self, namespace: str, pod: str) -> None:
        with self._lock:
            for key in [k for k in self.admitted if k[:2] == (namespace, pod)]:
                del self.admitted[key]
        self._reuse.pop((namespace, pod), None)

    def _allocate_one(
        self, record: Admitted, resource: str, units: int, reusable: list[str] | None
    ) -> None:
        with self._lock:
            endpoint = self.endpoints.get(resource)
        if endpoint is None:
            raise AdmissionError("UnexpectedAdmissionError", f"no plugin registered for {resource}")
        with self._lock:
            # The devices of init containers were handed on, so they count as taken only
            # through the containers that hold them now.
            taken = {d for a in self.admitted.values() for d in a.devices.get(resource, ())}
            healthy = endpoint.healthy
        reused = [d for d in (reusable or []) if d in endpoint.devices][:units]
        available = [d for d in healthy if d not in taken]
        if len(reused) + len(available) < units:
            raise AdmissionError(
                "OutOfResources", f"Insufficient {resource}: {len(available)} free, {units} asked"
            )
        clock = time.perf_counter
        try:
            if len(reused) == units:
                chosen = reused
            elif endpoint.options.get_preferred_allocation_available:
                chosen = self._preferred(endpoint, resource, reused, available, units)
            else:
                chosen = reused + available[: units - len(reused)]
            allocate = api_pb2.AllocateRequest(
                container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=chosen)]
            )
            started = clock()
            reply_all = endpoint.stub.Allocate(allocate, timeout=ADMISSION_CALL_TIMEOUT)
            response = reply_all.container_responses[0]
            if self.observe is not None:
                self.observe(resource, "Allocate", clock() - started)
        except grpc.RpcError as exc:
            raise AdmissionError(
                "UnexpectedAdmissionError", exc.details() or "", exc.code()
            ) from None
        record.devices[resource] = chosen
        record.responses[resource] = response
        _merge(record, response)

    def _preferred(
        self,
        endpoint: Endpoint,
        resource: str,
        reused: list[str],
        available: list[str],
        units: int,
    ) -> list[str]:
        """The devices to allocate as the plugin prefers them (GetPreferredAllocation),
        ``reused`` first; what it does not name is filled from ``available`` in order."""
        offer = reused + available
        request = api_pb2.PreferredAllocationRequest(
            container_requests=[
                api_pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=offer,
                    must_include_deviceIDs=reused,
                    allocation_size=units,
                )
            ]
        )
        started = time.perf_counter()
        reply = endpoint.stub.GetPreferredAllocation(request, timeout=ADMISSION_CALL_TIMEOUT)
        if self.observe is not None:
            self.observe(resource, "GetPreferredAllocation", time.perf_counter() - started)
        offered = set(offer)
        preferred = list(reused)
        for d in reply.container_responses[0].deviceIDs:
            if d in offered and d not in preferred and len(preferred) < units:
                preferred.append(d)
        picked = set(preferred)
        return preferred + [d for d in available if d not in picked][: units - len(preferred)]

    def release(self, pod: str, container: str | None = None, namespace: str = "default") -> None:
        with self._lock:
            for key in list(self.admitted):
                if key[:2] == (namespace, pod) and container in (None, key[2]):
                    del self.admitted[key]

    def end(self, pod: str, namespace: str = "default") -> None:
        """The pod's termination completes during the next container's admission: its
        devices are still counted in the offer of that container's first resource and
        freed by the first ``List`` once that admission began (or by the allocation
        after it)."""
        with self._lock:
            self.ended[namespace, pod] = self.admissions_started

    def release_all(self, pods: Iterable[str]) -> None:
        for pod in pods:
            self.release(pod)
