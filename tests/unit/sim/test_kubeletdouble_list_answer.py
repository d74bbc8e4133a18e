"""The kubelet stand-in's PodResources ``List`` answer: one entry per device, as the real
kubelet (1.36) lists them, for the pods admitted now, whatever was admitted, grown,
changed or released before (it keeps each pod's encoded entry between answers)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from kit.sizes import at_two_sizes

from gpushare._proto.podresources.v1 import api_pb2 as pr
from gpushare.sim.kubeletdouble import Admitted, PodResourcesLister

MEMORY, CORE = "gpushare.io/vcuda-memory", "gpushare.io/vcuda-core"


def built_anew(lister: PodResourcesLister) -> pr.ListPodResourcesResponse:
    """The answer as the stand-in built it before it kept entries: every pod anew."""
    by_pod: dict[tuple[str, str], list[Admitted]] = {}
    for record in lister.admitted.values():
        if not record.init:
            by_pod.setdefault((record.namespace, record.pod), []).append(record)
    return pr.ListPodResourcesResponse(
        pod_resources=[
            pr.PodResources(
                name=pod,
                namespace=namespace,
                containers=[
                    pr.ContainerResources(
                        name=r.container,
                        devices=[
                            pr.ContainerDevices(
                                resource_name=res,
                                device_ids=[device],
                                topology=pr.TopologyInfo(nodes=[pr.NUMANode(ID=0)]),
                            )
                            for res, ids in r.devices.items()
                            for device in ids
                        ],
                    )
                    for r in records
                ],
            )
            for (namespace, pod), records in by_pod.items()
        ]
    )


keys = st.tuples(
    st.sampled_from(["a", "b"]), st.sampled_from(["p", "q", "r"]), st.sampled_from(["c1", "c2"])
)
held = st.dictionaries(
    st.sampled_from([MEMORY, CORE]),
    st.lists(st.sampled_from([f"GPU-{c}::{n}" for c in "xy" for n in range(4)]), max_size=4),
    max_size=2,
)
steps = st.lists(
    st.tuples(st.sampled_from(["admit", "grow", "release"]), keys, held, st.booleans()),
    max_size=12,
)


@at_two_sizes(given(steps), quick=50, full=200, deadline=None)
def test_each_answer_lists_what_is_admitted_now(
    sequence: list[tuple[str, tuple[str, str, str], dict[str, list[str]], bool]],
) -> None:
    lister = PodResourcesLister(list_rate=1e9, list_burst=10**9)
    for action, key, devices, init in sequence:
        namespace, pod, container = key
        if action == "admit":
            record = Admitted(pod, container, namespace, dict(devices), {}, {}, {}, {}, [])
            record.init = init
            lister.admitted[key] = record
        elif action == "grow" and key in lister.admitted:
            lister.admitted[key].devices.update(devices)  # the second resource admitted
        else:
            lister.admitted.pop(key, None)
        assert lister.list_response() == built_anew(lister)
