"""The kubelet's records of who holds which devices (PodResources API, ``v1.List``).

This is gpushare's only source of truth about allocations: there is no private
checkpoint, so a daemon restarted in the middle of a busy node (even by ``kill -9``)
agrees with the kubelet at once. A missing, refusing or failing socket yields
``None`` and a log line, never an exception.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

import grpc
import structlog
from google.protobuf.message import DecodeError

from gpushare._proto.podresources.v1 import api_pb2
from gpushare.share.devices import Resource
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder

log = structlog.get_logger(__name__)

LIST_TIMEOUT = 2.0
LIST_METHOD = "/v1.PodResourcesLister/List"
#: First pause before asking again when the kubelet's rate limit refused a read.
EXHAUSTED_PAUSE = 0.01


def _add_pod(
    pod: api_pb2.PodResources,
    resources: Mapping[str, Resource],
    exclusive: Collection[str],
    snapshot: Snapshot,
) -> None:
    """Record one pod's devices of our resources in ``snapshot``."""
    holders, by_holder, by_exclusive = snapshot.holders, snapshot.devices, snapshot.exclusive
    namespace, name = pod.namespace, pod.name
    for container in pod.containers:
        holder = Holder(namespace, name, container.name)
        for devices in container.devices:
            resource_name = devices.resource_name
            resource = resources.get(resource_name)
            if resource is None:
                if resource_name in exclusive:
                    owners = by_exclusive.setdefault(resource_name, {})
                    owners.update(dict.fromkeys(devices.device_ids, holder))
                continue
            ids = list(devices.device_ids)
            by_holder.setdefault(holder, {}).setdefault(resource, []).extend(ids)
            for device_id in ids:
                holders[resource, device_id] = holder


def parse_list_response(
    response: api_pb2.ListPodResourcesResponse,
    resources: Mapping[str, Resource],
    taken_at: float,
    exclusive: Collection[str] = (),
) -> Snapshot:
    """Keep only the devices of our resources (``resources``: full name -> Resource;
    ``exclusive``: full names of the exclusive resources)."""
    snapshot = Snapshot(taken_at)
    for pod in response.pod_resources:
        _add_pod(pod, resources, exclusive, snapshot)
    return snapshot


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ValueError("a varint runs past the end")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")


def pod_entries(data: bytes) -> list[bytes]:
    """The serialized ``PodResources`` entries (field 1) of a serialized
    ``ListPodResourcesResponse``, split at the wire level, not decoded. ValueError for
    bytes that are not such a message (the caller then decodes them whole, and
    protobuf says what is wrong)."""
    entries = []
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        if key & 7 != 2:  # the response holds length-delimited fields only
            raise ValueError(f"wire type {key & 7} at the top level")
        size, pos = _varint(data, pos)
        if pos + size > end:
            raise ValueError("an entry runs past the end")
        if key >> 3 == 1:
            entries.append(data[pos : pos + size])
        pos += size
    return entries


class ListParser:
    """Turns the kubelet's serialized List answers into :class:`Snapshot` s, decoding
    only the pods whose entry changed since the last answer.

    The kubelet answers one entry per device (1.36): a busy node's answer holds
    thousands, and field access in protobuf's Python objects costs about a microsecond
    each, so decoding all of it took ~4 ms per read of a node with 64 containers, on
    the admission path. Between two reads most pods are byte-for-byte the same: each
    entry is kept with what it held, keyed by its bytes, for the next answer."""

    def __init__(self, resources: Mapping[str, Resource], exclusive: Collection[str]) -> None:
        self.resources = dict(resources)
        self.exclusive = frozenset(exclusive)
        self._parts: dict[bytes, Snapshot] = {}
        self.decoded = 0  # pod entries decoded so far (the others were kept)

    def parse(self, data: bytes, taken_at: float) -> Snapshot:
        """The snapshot of one serialized answer; DecodeError where it is not one."""
        try:
            entries = pod_entries(data)
        except ValueError:
            response = api_pb2.ListPodResourcesResponse.FromString(data)
            return parse_list_response(response, self.resources, taken_at, self.exclusive)
        parts: dict[bytes, Snapshot] = {}
        kept = self._parts
        for entry in entries:
            part = parts.get(entry) or kept.get(entry)
            if part is None:
                part = Snapshot(taken_at)
                pod = api_pb2.PodResources.FromString(entry)
                self.decoded += 1
                _add_pod(pod, self.resources, self.exclusive, part)
            parts[entry] = part
        self._parts = parts
        # every entry in the answer's order: a pod listed twice joins twice, as decoding whole does
        return Snapshot.joined(taken_at, map(parts.__getitem__, entries))


class PodResourcesClient:
    """Reads the kubelet's PodResources ``List``: always a read that began after the
    caller asked, never an older answer.

    Concurrent callers share one read in flight when it began after they asked; a
    caller that arrived later than the read in flight waits for it to end and starts
    its own. There is no client-side throttle: the kubelet limits the API itself
    (about 100 requests a second, burst 10) and answers ``ResourceExhausted`` beyond
    that, which reads here as "no fresh records" (None), like a missing socket.

    Only an endpoint that answers is waited for, however slowly. After a read that ran
    out of time (the kubelet accepted the call and never answered, or a caller's wait
    for the read in flight ended first), callers are answered None at once
    (:attr:`waits_skipped` counts them) and decide from what they have, while one read
    at a time goes on in the background with the patience of the caller that started
    it; the first read the kubelet answers ends this (an error answered at once costs
    no wait either). A hung PodResources endpoint so costs
    one wait, not one per request (issue 41.7: 5 s per resource, 10 s per admission,
    before).

    What a read that ran out proves depends on how long it was willing to wait: the
    kubelet did not answer within that read's patience, nothing more. So only callers
    whose patience is no longer than the longest one that ran out are answered at once
    (:attr:`unanswered_after`). The usage refresher's read (2 s) running out on a busy
    kubelet does not make an admission (5 s, ``RECORDS_WAIT``) decide without the
    records it would have had within its own wait; an admission's read running out
    makes every caller of that patience or less skip.
    """

    def __init__(
        self,
        socket: Path,
        resources: Mapping[str, Resource],
        *,
        clock: Callable[[], float] = time.monotonic,
        exclusive: Collection[str] = (),
    ) -> None:
        self.socket = socket
        self.resources = dict(resources)
        self.exclusive = frozenset(exclusive)
        self._clock = clock
        self._cond = threading.Condition()
        self._channel: grpc.Channel | None = None
        self._stub: grpc.UnaryUnaryMultiCallable[api_pb2.ListPodResourcesRequest, bytes] | None = (
            None
        )
        self._failing = False
        self._inflight: float | None = None  # when the read in flight began
        self._done: tuple[float, Snapshot | None, str] | None = None  # last read: began, result
        self._parser = ListParser(self.resources, self.exclusive)
        self.last: Snapshot | None = None  # the newest snapshot read successfully
        self.last_error = ""
        #: the longest patience (seconds) of a read that ran out of time since the kubelet
        #: last answered; 0.0 while it answers. Callers with no more patience than this
        #: are answered at once.
        self.unanswered_after = 0.0
        #: callers that waited until their time ran out (none while ``unanswered``), and
        #: callers answered at once because a read had run out
        self.waits_run_out = 0
        self.waits_skipped = 0

    @property
    def unanswered(self) -> bool:
        """A read ran out of time and none has been answered since."""
        return self.unanswered_after > 0.0

    @property
    def decoded(self) -> int:
        """Pod entries decoded since start: only those that changed between answers."""
        return self._parser.decoded

    def list(self, *, timeout: float = LIST_TIMEOUT) -> Snapshot | None:
        """A snapshot read from now on; None when the kubelet cannot be read."""
        return self.read_after(self._clock(), timeout=timeout)

    def read_after(self, not_before: float, *, timeout: float = LIST_TIMEOUT) -> Snapshot | None:
        """A snapshot whose read began at or after ``not_before`` (clock time), or None
        when none could be had within ``timeout`` seconds (``last_error`` says why)."""
        deadline = self._clock() + timeout
        with self._cond:
            while True:
                done = self._done
                if done is not None and done[0] >= not_before:
                    return done[1]
                if self.unanswered and self.unanswered_after >= timeout:
                    self._skip_wait(timeout)
                    return None
                if self._inflight is None:
                    began = self._inflight = self._clock()
                    break
                left = deadline - self._clock()
                if left <= 0:
                    self.last_error = "the read in flight did not end in time"
                    self.waits_run_out += 1
                    self._ran_out(timeout)
                    return None
                self._cond.wait(left)
        return self._read(began, deadline, timeout, waited=True)

    def _read(
        self, began: float, deadline: float, patience: float, *, waited: bool
    ) -> Snapshot | None:
        """The read that began at ``began`` (its caller set ``_inflight``) for a caller
        willing to wait ``patience`` seconds in all; ``waited``: a caller waits for it
        (else it runs in the background)."""
        snapshot: Snapshot | None = None
        error = "the read failed"
        ran_out = False
        try:
            snapshot, error, ran_out = self._call(began, max(0.01, deadline - self._clock()))
        except Exception as exc:  # e.g. the socket's directory unreadable: never wedge
            error = self._report_failure(f"{type(exc).__name__}: {exc}")
        finally:
            self._finish(began, snapshot, error, patience if ran_out else 0.0, waited)
        return snapshot

    def _skip_wait(self, timeout: float) -> None:
        """Under the lock, the endpoint not answering: no wait. One read at a time goes
        on in the background (with this caller's patience) until one is answered."""
        self.waits_skipped += 1
        self.last_error = (
            "PodResources did not answer a read in time and has not answered since; "
            "not waited for until it does"
        )
        if self._inflight is not None:
            return
        began = self._inflight = self._clock()
        threading.Thread(
            target=self._read,
            args=(began, began + timeout, timeout),
            kwargs={"waited": False},
            name="pod-resources-retry",
            daemon=True,
        ).start()

    def _ran_out(self, patience: float) -> None:
        """Under the lock: a read for a caller of ``patience`` seconds ran out of time."""
        if patience <= self.unanswered_after:
            return
        self.unanswered_after = patience
        log.warning(
            "pod_resources_not_answering",
            socket=str(self.socket),
            waited_seconds=round(patience, 3),
            detail="requests that would wait no longer than this decide without the "
            "kubelet's records, without waiting, until a read succeeds again",
        )

    def _finish(
        self,
        began: float,
        snapshot: Snapshot | None,
        error: str,
        ran_out_after: float,
        waited: bool,
    ) -> None:
        """Under no lock: the read that began at ``began`` ended; ``ran_out_after``: the
        patience of the caller it ran out of time for (0.0: it did not run out)."""
        with self._cond:
            self._inflight = None
            self._done = (began, snapshot, error)
            if snapshot is not None:
                self.last = snapshot
            if ran_out_after > 0.0:
                self.waits_run_out += waited
                self._ran_out(ran_out_after)
            elif self.unanswered:  # it answered (an error answered at once costs no wait)
                self.unanswered_after = 0.0
                log.info("pod_resources_answering", socket=str(self.socket), error=error)
            self.last_error = error
            self._cond.notify_all()

    def _call(self, began: float, timeout: float) -> tuple[Snapshot | None, str, bool]:
        """One List call, outside every lock: (snapshot, error, whether it ran out of time)."""
        if not self.socket.exists():
            return None, self._report_failure("socket missing"), False
        with self._cond:
            if self._stub is None:
                self._channel = grpc.insecure_channel(f"unix://{self.socket}")
                # the answer as bytes: the parser decodes only what changed
                self._stub = self._channel.unary_unary(
                    LIST_METHOD,
                    request_serializer=api_pb2.ListPodResourcesRequest.SerializeToString,
                    response_deserializer=None,
                )
            stub = self._stub
        deadline = self._clock() + timeout
        pause = EXHAUSTED_PAUSE
        while True:
            try:
                response = stub(
                    api_pb2.ListPodResourcesRequest(), timeout=max(0.01, deadline - self._clock())
                )
                break
            except grpc.RpcError as exc:
                code = exc.code()
                error = f"{code.name}: {exc.details()}"
                if code is grpc.StatusCode.RESOURCE_EXHAUSTED and self._clock() + pause < deadline:
                    # The kubelet's limiter refills a token every 10 ms: the same fresh
                    # read is asked again, never an older answer handed out.
                    time.sleep(pause)
                    pause *= 2
                    continue
                if code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    with self._cond:
                        self._reset()
                ran_out = code is grpc.StatusCode.DEADLINE_EXCEEDED
                return None, self._report_failure(error), ran_out
            except ValueError as exc:  # the channel was closed under us (shutdown)
                return None, self._report_failure(str(exc)), False
        if self._failing:
            log.info("pod_resources_readable", socket=str(self.socket))
            self._failing = False
        try:
            return self._parser.parse(response, began), "", False
        except DecodeError as exc:
            error = self._report_failure(f"the answer is not a List response: {exc}")
            return None, error, False

    def _report_failure(self, error: str) -> str:
        if not self._failing:
            log.warning("pod_resources_unreadable", socket=str(self.socket), error=error)
            self._failing = True
        return error

    def _reset(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None
        self._stub = None

    def close(self) -> None:
        with self._cond:
            self._reset()
