"""What the asking container's own pod spec makes a shared-units Allocate refuse
(``deviceplugin/specrefusals.py``), where that container is the only one the pods on
record can be: a spec that sets what carries its limits (reserved env names, a volume
over the interposer's paths), cores without memory units, shared units beside a whole
card or MIG device the records show it holding. Each refusal is one line naming the
container, its pod and what it set; an honest spec is refused for nothing; the second
half of a container (a partner decision) is never refused from the spec, except for
mixing kinds.

Kept to the case of one candidate: which of several pending pods of one shape is asking
is another question (``test_specrefusals.py``, issue 41 item 10).
"""

from __future__ import annotations

from typing import Any

from hypothesis import assume, given
from hypothesis import strategies as st
from kit.sizes import at_two_sizes
from structlog.testing import capture_logs

from gpushare.deviceplugin.specrefusals import core_without_memory, mixed_kinds, spec_refusal
from gpushare.kube.podspecs import PodSpecBook
from gpushare.share.devices import Resource
from gpushare.share.pairing import Basis, Binding, Decision
from gpushare.share.records import Snapshot
from gpushare.share.reserved import (
    RESERVED_NAMES,
    RESERVED_PATHS,
    RESERVED_PREFIXES,
    env_reserved,
    path_reserved,
    tampering,
)
from gpushare.share.reserved import refusal as reserved_refusal
from gpushare.share.usage import Holder

NOT_PAIRED = Decision(None, Basis.NOTHING_TO_PAIR)
PARTNER = Decision(Binding(Resource.MEMORY, "GPU-0", ("GPU-0::0",), 0.0), Basis.PARTNER)

labels = st.from_regex(r"[a-z]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True)
prefixes = st.sampled_from(["gpushare.io", "example.com"])
reserved_env = st.one_of(
    st.sampled_from(RESERVED_NAMES),
    st.builds("".join, st.tuples(st.sampled_from(RESERVED_PREFIXES),
                                 st.from_regex(r"[A-Z0-9_]{0,6}", fullmatch=True))),
)  # fmt: skip
honest_env = st.from_regex(r"[A-Z][A-Z0-9_]{0,12}", fullmatch=True).filter(
    lambda name: not env_reserved(name)
)
reserved_mounts = st.builds(
    "".join, st.tuples(st.sampled_from(RESERVED_PATHS), st.sampled_from(["", "/x", "/a/b"]))
)
honest_mounts = st.builds("/data/{}".format, labels).filter(lambda p: not path_reserved(p))
records = st.sampled_from([None, Snapshot(0.0)])


def container(name: str, limits: dict[str, int], env: list[str], mounts: list[str]) -> dict:
    return {
        "name": name,
        "resources": {"limits": {k: str(v) for k, v in limits.items()}},
        "env": [{"name": n, "value": "1"} for n in env],
        "volumeMounts": [{"name": f"v{i}", "mountPath": p} for i, p in enumerate(mounts)],
    }


def only(prefix: str, namespace: str, pod: str, spec: dict[str, Any]) -> PodSpecBook:
    """A book holding one pending pod with this one GPU container."""
    book = PodSpecBook(prefix)
    book.update({
        "metadata": {"uid": f"uid-{pod}", "namespace": namespace, "name": pod},
        "spec": {"containers": [spec]},
        "status": {"phase": "Pending"},
    })  # fmt: skip
    return book


def shared(prefix: str, memory: int, core: int) -> dict[str, int]:
    return {f"{prefix}/vcuda-memory": memory, f"{prefix}/vcuda-core": core}


@at_two_sizes(
    given(prefixes, labels, labels, labels, st.integers(1, 64), st.integers(1, 100),
          st.sampled_from(list(Resource)), st.lists(reserved_env, max_size=3),
          st.lists(reserved_mounts, max_size=2), records),
    quick=100, full=1000, deadline=None,
)  # fmt: skip
def test_a_spec_that_sets_what_carries_its_limits_is_refused_naming_what(
    prefix: str, namespace: str, pod: str, name: str, memory: int, core: int,
    resource: Resource, env: list[str], mounts: list[str], snapshot: Snapshot | None,
) -> None:  # fmt: skip
    spec = container(name, shared(prefix, memory, core), env, mounts)
    book = only(prefix, namespace, pod, spec)
    size = memory if resource is Resource.MEMORY else core
    with capture_logs() as logs:
        refused = spec_refusal(book, resource, size, snapshot, NOT_PAIRED, None)
    if not env and not mounts:
        assert refused is None
        return
    why = tampering(spec)
    assert why is not None
    assert refused == reserved_refusal(f"{pod}/{name}", why)
    assert "\n" not in refused
    for word in (*env, *mounts, f"{pod}/{name}"):
        assert word in refused
    warned = [e for e in logs if e["event"] == "reserved_settings_refused"]
    assert [(e["holder"], e["reason"]) for e in warned] == [
        (str(Holder(namespace, pod, name)), why)
    ]


@at_two_sizes(
    given(prefixes, labels, labels, st.integers(1, 64), st.integers(0, 100),
          st.sampled_from(list(Resource)), st.lists(honest_env, max_size=3),
          st.lists(honest_mounts, max_size=2), records),
    quick=100, full=1000, deadline=None,
)  # fmt: skip
def test_an_honest_spec_asking_memory_is_refused_for_nothing(
    prefix: str, pod: str, name: str, memory: int, core: int, resource: Resource,
    env: list[str], mounts: list[str], snapshot: Snapshot | None,
) -> None:  # fmt: skip
    book = only(prefix, "t", pod, container(name, shared(prefix, memory, core), env, mounts))
    assume(resource is Resource.MEMORY or core > 0)
    size = memory if resource is Resource.MEMORY else core
    assert spec_refusal(book, resource, size, snapshot, NOT_PAIRED, None) is None


@at_two_sizes(
    given(prefixes, labels, labels, labels, st.integers(1, 100), st.sampled_from([None, 0]),
          st.lists(reserved_env, max_size=2), records),
    quick=100, full=1000, deadline=None,
)  # fmt: skip
def test_cores_without_memory_are_refused_naming_both_resources(
    prefix: str, namespace: str, pod: str, name: str, core: int, memory: int | None,
    env: list[str], snapshot: Snapshot | None,
) -> None:  # fmt: skip
    limits = {f"{prefix}/vcuda-core": core}
    if memory is not None:
        limits[f"{prefix}/vcuda-memory"] = memory  # 0: the kubelet skips it, as if absent
    book = only(prefix, namespace, pod, container(name, limits, env, []))
    refused = spec_refusal(book, Resource.CORE, core, snapshot, NOT_PAIRED, None)
    # before whatever else its spec sets: it would run with the whole card's memory
    assert refused == core_without_memory(Holder(namespace, pod, name), prefix)
    assert f"container {name} of pod {namespace}/{pod}" in refused
    assert f"{prefix}/vcuda-core without {prefix}/vcuda-memory" in refused
    assert "\n" not in refused
    # a request of another size is not this container's
    assert spec_refusal(book, Resource.CORE, core + 1, snapshot, NOT_PAIRED, None) is None


@at_two_sizes(
    given(prefixes, labels, labels, st.integers(1, 64), st.integers(1, 100),
          st.sampled_from(list(Resource)), st.lists(reserved_env, min_size=1, max_size=2)),
    quick=50, full=500, deadline=None,
)  # fmt: skip
def test_the_second_half_of_a_container_is_not_refused_from_its_spec(
    prefix: str, pod: str, name: str, memory: int, core: int, resource: Resource,
    env: list[str],
) -> None:  # fmt: skip
    """Its first half was checked when it was bound (the binder refuses there)."""
    for limits in (shared(prefix, memory, core), {f"{prefix}/vcuda-core": core}):
        book = only(prefix, "t", pod, container(name, limits, env, []))
        size = memory if resource is Resource.MEMORY else core
        assert spec_refusal(book, resource, size, Snapshot(0.0), PARTNER, None) is None


@at_two_sizes(
    given(prefixes, labels, labels, labels, st.integers(1, 64),
          st.sampled_from(["gpu", "mig-1g.10gb"]), st.sampled_from([NOT_PAIRED, PARTNER])),
    quick=100, full=1000, deadline=None,
)  # fmt: skip
def test_shared_units_beside_a_whole_card_it_holds_are_refused_as_mixed(
    prefix: str, namespace: str, pod: str, name: str, memory: int, kind: str,
    decision: Decision,
) -> None:  # fmt: skip
    exclusive = f"{prefix}/{kind}"
    limits = {exclusive: 1, f"{prefix}/vcuda-memory": memory}
    book = only(prefix, namespace, pod, container(name, limits, [], []))
    holder = Holder(namespace, pod, name)
    holds_card = Snapshot(0.0, exclusive={exclusive: {"GPU-0": holder}})
    refused = spec_refusal(book, Resource.MEMORY, memory, holds_card, decision, None)
    assert refused == mixed_kinds(holder)
    assert f"container {name} of pod {namespace}/{pod}" in refused
    assert "together with whole cards or MIG devices" in refused
    # before it holds the card (the kubelet may ask the shared units first), the records
    # do not show it mid-admission: the exclusive side's Allocate refuses it instead
    assert spec_refusal(book, Resource.MEMORY, memory, Snapshot(0.0), decision, None) is None


@given(labels, labels, labels, prefixes)
def test_each_refusal_is_one_line_naming_the_container_and_its_pod(
    namespace: str, pod: str, name: str, prefix: str
) -> None:
    holder = Holder(namespace, pod, name)
    for text in (mixed_kinds(holder), core_without_memory(holder, prefix)):
        assert "\n" not in text
        assert text.startswith(f"container {name} of pod {namespace}/{pod} asks for ")
