"""A stand-in for the kubelet's side of DRA: plugin watcher, DRA manager calls, health.

What the real kubelet (1.34-1.37) does with a DRA driver, over the same sockets:

* finds ``<root>/plugins_registry/*.sock`` (dot files skipped), calls
  ``Registration.GetInfo``, checks the type is ``DRAPlugin`` and picks the first service
  of ``supported_versions`` it knows (``v1.DRAPlugin``, then ``v1beta1.DRAPlugin``;
  neither: refused), then ``NotifyRegistrationStatus``;
* calls ``NodePrepareResources`` / ``NodeUnprepareResources`` of the chosen version on
  the endpoint from GetInfo, with only namespace, name and UID of each claim;
* opens ``DRAResourceHealth.NodeWatchResources`` when the plugin offers it.

:func:`allocated_claim` writes a ResourceClaim as the scheduler leaves it (allocated,
with ``consumedCapacity`` and a ``shareID`` per result), for the API-server double.
"""

from __future__ import annotations

import uuid as uuidlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from gpushare._proto.dra.v1 import api_pb2 as v1
from gpushare._proto.dra.v1 import api_pb2_grpc as v1_grpc
from gpushare._proto.dra.v1beta1 import api_pb2 as v1beta1
from gpushare._proto.dra.v1beta1 import api_pb2_grpc as v1beta1_grpc
from gpushare._proto.drahealth.v1alpha1 import api_pb2 as health_pb2
from gpushare._proto.drahealth.v1alpha1 import api_pb2_grpc as health_grpc
from gpushare._proto.pluginregistration.v1 import api_pb2 as reg_pb2
from gpushare._proto.pluginregistration.v1 import api_pb2_grpc as reg_grpc

KNOWN = {"v1.DRAPlugin": (v1, v1_grpc), "v1beta1.DRAPlugin": (v1beta1, v1beta1_grpc)}
HEALTH = "v1alpha1.DRAResourceHealth"


class RegistrationRefused(Exception):
    pass


@dataclass(frozen=True)
class Prepared:
    """One claim's answer: (request names, pool, device, CDI IDs) per device, or error."""

    devices: list[tuple[list[str], str, str, list[str]]]
    error: str


class DraKubelet:
    """One kubelet's DRA side, for one plugin found in ``root/plugins_registry``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.info: Any = None
        self.version = ""
        self._channel: grpc.Channel | None = None

    def registration_sockets(self) -> list[Path]:
        folder = self.root / "plugins_registry"
        if not folder.is_dir():
            return []
        return sorted(
            p for p in folder.iterdir() if p.name.endswith(".sock") and not p.name.startswith(".")
        )

    def register(self, socket: Path | None = None, versions: Sequence[str] = tuple(KNOWN)) -> str:
        """Register the plugin at ``socket`` (default: the only one found); the chosen
        service. ``versions``: the DRAPlugin services this kubelet knows."""
        if socket is None:
            (socket,) = self.registration_sockets()
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            stub = reg_grpc.RegistrationStub(channel)
            info = stub.GetInfo(reg_pb2.InfoRequest(), timeout=5)
            chosen = next((v for v in info.supported_versions if v in versions), "")
            error = ""
            if info.type != "DRAPlugin":
                error = f"type {info.type!r} is not DRAPlugin"
            elif not chosen:
                error = f"none of {list(info.supported_versions)} is supported"
            stub.NotifyRegistrationStatus(
                reg_pb2.RegistrationStatus(plugin_registered=not error, error=error), timeout=5
            )
        if error:
            raise RegistrationRefused(error)
        self.info, self.version = info, chosen
        self.close()
        self._channel = grpc.insecure_channel(f"unix://{info.endpoint}")
        return chosen

    def _stub(self) -> tuple[Any, Any]:
        if self._channel is None:
            raise RuntimeError("not registered")
        pb2, pb2_grpc = KNOWN[self.version]
        return pb2, pb2_grpc.DRAPluginStub(self._channel)

    def prepare(
        self, claims: Sequence[tuple[str, str, str]], timeout: float = 30
    ) -> dict[str, Prepared]:
        """``(namespace, name, uid)`` of each claim -> its answer, by UID (``timeout``:
        the call's deadline, as the kubelet sets one)."""
        pb2, stub = self._stub()
        request = pb2.NodePrepareResourcesRequest(
            claims=[pb2.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        response = stub.NodePrepareResources(request, timeout=timeout)
        return {
            uid: Prepared(
                [
                    (list(d.request_names), d.pool_name, d.device_name, list(d.cdi_device_ids))
                    for d in answer.devices
                ],
                answer.error,
            )
            for uid, answer in response.claims.items()
        }

    def unprepare(
        self, claims: Sequence[tuple[str, str, str]], timeout: float = 30
    ) -> dict[str, str]:
        pb2, stub = self._stub()
        request = pb2.NodeUnprepareResourcesRequest(
            claims=[pb2.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in claims]
        )
        response = stub.NodeUnprepareResources(request, timeout=timeout)
        return {uid: answer.error for uid, answer in response.claims.items()}

    def watch_health(self) -> Iterator[dict[str, str]]:
        """The health stream: each message as {device name: HEALTHY/UNHEALTHY/UNKNOWN}."""
        if self._channel is None or HEALTH not in self.info.supported_versions:
            raise RuntimeError("the plugin offers no health service")
        stub = health_grpc.DRAResourceHealthStub(self._channel)
        for message in stub.NodeWatchResources(health_pb2.NodeWatchResourcesRequest()):
            yield {
                d.device.device_name: health_pb2.HealthStatus.Name(d.health)
                for d in message.devices
            }

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None


def allocated_claim(
    namespace: str,
    name: str,
    driver: str,
    pool: str,
    results: Sequence[Mapping[str, Any]],
    *,
    uid: str | None = None,
    reserved_for: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """A ResourceClaim as the scheduler leaves it: ``results`` are ``{request, device,
    consumedCapacity?}``; driver, pool and a shareID are filled in; ``reserved_for``:
    the (name, UID) of the pods it is reserved for."""
    reservations = [{"resource": "pods", "name": n, "uid": u} for n, u in reserved_for]
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuidlib.uuid4())},
        "spec": {"devices": {"requests": []}},
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"driver": driver, "pool": pool, "shareID": str(uuidlib.uuid4()), **r}
                        for r in results
                    ]
                }
            },
            **({"reservedFor": reservations} if reservations else {}),
        },
    }


def pod_using_claims(
    namespace: str,
    name: str,
    node: str,
    containers: Mapping[str, Sequence[str]],
    *,
    templates: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A Pod whose containers use ResourceClaims: ``containers`` maps each container to
    the ResourceClaim names it uses (``resources.claims``). A claim named in ``templates``
    (ResourceClaim name -> pod claim name) is one the pod's template generated: the pod
    names the template, and its status the claim, as the resourceclaim controller leaves
    it; every other claim is named in ``spec.resourceClaims`` directly."""
    generated = dict(templates or {})
    used = sorted({c for names in containers.values() for c in names})
    pod_claim = {c: generated.get(c, f"pc-{c}") for c in used}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeName": node,
            "resourceClaims": [
                {"name": pod_claim[c], "resourceClaimTemplateName": "template"}
                if c in generated
                else {"name": pod_claim[c], "resourceClaimName": c}
                for c in used
            ],
            "containers": [
                {
                    "name": container,
                    "image": "app",
                    "resources": {"claims": [{"name": pod_claim[c]} for c in names]},
                }
                for container, names in containers.items()
            ],
        },
        "status": {
            "phase": "Pending",
            "resourceClaimStatuses": [
                {"name": pod_claim[c], "resourceClaimName": c} for c in used if c in generated
            ],
        },
    }
