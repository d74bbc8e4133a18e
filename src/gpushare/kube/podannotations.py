"""The pod annotations of the API link: which card each admitted container got.

After every Allocate the daemon annotates the pod with the card (or the whole devices)
each of its containers got (``<prefix>/gpu.<container>: <uuid>``), for people and for
``kubectl gpushare inspect``. :class:`PodAnnotator` keeps the queue of Allocates still
to annotate, finds each one's holder in the kubelet's records, skips what it annotated
lately and writes the rest; the API link runs it on its thread.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from gpushare.kube import nodestate
from gpushare.kube.podspecs import PodSpecBook
from gpushare.kube.stdlibclient import ApiClient, ApiStatusError
from gpushare.share.devices import Resource
from gpushare.share.records import Snapshot
from gpushare.share.usage import Holder

log = structlog.get_logger(__name__)

API_TIMEOUT = 5.0
POD_ANNOTATION_TRIES = 10
#: How many (pod, container, card) annotations are remembered to skip their repeats.
ANNOTATED_MEMORY = 4096
#: Answers to a pod patch that another try will not change (pod gone, RBAC, invalid).
FINAL_POD_PATCH_STATUSES = frozenset({403, 404, 422})


@dataclass
class _PendingPodAnnotation:
    resource: Resource | None  # None: a whole card or MIG device of ``exclusive``
    uuid: str  # the annotation's value: the card, or the whole devices, comma-separated
    first_id: str
    tries: int = 0
    exclusive: str = ""  # the exclusive resource's full name


class PodAnnotator:
    """The Allocates still to annotate on their pods, and those annotated lately."""

    def __init__(self, prefix: str, book: PodSpecBook) -> None:
        self.prefix = prefix
        self.book = book
        self._pending: deque[_PendingPodAnnotation] = deque()
        #: (pod UID, container, card) annotated lately, oldest first: skip the same again.
        self._annotated: dict[tuple[str, str, str], None] = {}
        self.handled = 0  # Allocates whose annotation was written or skipped

    def __bool__(self) -> bool:
        """True while an Allocate waits to be annotated."""
        return bool(self._pending)

    def shared(self, resource: Resource, uuid: str, first_id: str) -> None:
        """Shared units of card ``uuid`` were allocated, ``first_id`` the first."""
        self._pending.append(_PendingPodAnnotation(resource, uuid, first_id))

    def exclusive(self, resource: str, device_ids: list[str]) -> None:
        """Whole cards or MIG devices were allocated: annotated like a shared
        allocation (the value lists the devices)."""
        if device_ids:
            item = _PendingPodAnnotation(None, ",".join(device_ids), device_ids[0])
            item.exclusive = resource
            self._pending.append(item)

    def annotate(
        self, api: ApiClient, snapshot: Snapshot | None, republish: Callable[[], None]
    ) -> None:
        """Annotate every pending Allocate whose holder ``snapshot`` names (the others
        are tried again, up to :data:`POD_ANNOTATION_TRIES` times); ``republish`` after a
        whole device's (the records now name its holder). Raises, keeping what is left,
        when the API server cannot be reached."""
        retry: list[_PendingPodAnnotation] = []
        batch_only: list[tuple[str, str, str]] = []
        while self._pending:
            item = self._pending.popleft()
            holder = _holder(snapshot, item)
            if holder is None:
                item.tries += 1
                if item.tries < POD_ANNOTATION_TRIES:
                    retry.append(item)
                else:
                    self.handled += 1
                continue
            # A container's two resources name the same card: annotate it once. The pod's
            # UID keeps a pod re-created under the same name from being skipped.
            uid = self.book.uid_of(holder.namespace, holder.pod)
            done_key = (uid or f"{holder.namespace}/{holder.pod}", holder.container, item.uuid)
            if done_key in self._annotated:
                self.handled += 1
                continue
            try:
                written = self._write(api, holder, item.uuid)
            except Exception:
                # The API server is down or busy: keep it (and the rest) for later.
                self._pending.extendleft(reversed([item, *retry]))
                for done in batch_only:
                    self._annotated.pop(done, None)
                raise
            self.handled += 1
            if not written:
                continue
            if item.resource is None:
                republish()  # publish again: the records now name the holder
            self._remember(done_key)
            if uid is None:  # without a UID only this batch may skip the other resource
                batch_only.append(done_key)
        for done in batch_only:
            self._annotated.pop(done, None)
        self._pending.extend(retry)

    def _write(self, api: ApiClient, holder: Holder, uuid: str) -> bool:
        """Patch the annotation onto the holder's pod; False when the pod is gone or the
        patch refused for good (no retry would change that)."""
        key = nodestate.pod_annotation_key(self.prefix, holder.container)
        body = {"metadata": {"annotations": {key: uuid}}}
        path = f"/api/v1/namespaces/{holder.namespace}/pods/{holder.pod}"
        try:
            api.merge_patch(path, body, timeout=API_TIMEOUT)
        except ApiStatusError as exc:
            if exc.status not in FINAL_POD_PATCH_STATUSES:
                raise
            # Gone, forbidden or refused: no retry will change that; move on.
            log.warning(
                "pod_annotation_dropped",
                pod=holder.pod,
                namespace=holder.namespace,
                error=short_error(exc),
            )
            return False
        log.info(
            "pod_annotated",
            pod=holder.pod,
            namespace=holder.namespace,
            container=holder.container,
            gpu=uuid,
        )
        return True

    def _remember(self, done_key: tuple[str, str, str]) -> None:
        self._annotated[done_key] = None
        while len(self._annotated) > ANNOTATED_MEMORY:
            self._annotated.pop(next(iter(self._annotated)))


def _holder(snapshot: Snapshot | None, item: _PendingPodAnnotation) -> Holder | None:
    if snapshot is None:
        return None
    if item.resource is None:
        return snapshot.exclusive.get(item.exclusive, {}).get(item.first_id)
    return snapshot.holder_of(item.resource, item.first_id)


def short_error(exc: Exception) -> str:
    """The exception's type and first line, at most 300 characters (for a log)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]
