"""A node reboot empties every tmpfs: the CDI directory where the claims' specs are and the
cache tmpfs where their directories are; the DRA checkpoint (on disk) survives. The kubelet
keeps a claim's "prepared" flag in memory only and calls NodePrepareResources again
(kubernetes/kubernetes#141966): the daemon must answer the same devices AND make the spec
and the directories again, the same, or the pod stays in CreateContainerError for ever
(the bug of kubernetes/kubernetes#141433, kubernetes-sigs/dra-example-driver#259).

Driven over the real sockets (the DRA kubelet stand-in, the API-server double): a "reboot"
is the daemon stopped, the CDI directory and the cache root emptied like a fresh tmpfs, the
daemon started again, and the kubelet's prepare called again."""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kit.procs import eventually  # noqa: F401  (imported by the sibling tests too)
from structlog.testing import capture_logs
from test_dra_plugin import DRIVER, DraNode, dra, env_of  # noqa: F401  (dra: the fixture)

from gpushare.host.library import cache_root


def spec_file(node: DraNode, uid: str) -> Path:
    return node.cdi / f"{DRIVER}-claim_{uid}.json"


def entry_file(node: DraNode, uid: str) -> Path:
    return node.host / "dra" / "claims" / f"{uid}.json"


def claim_dirs(node: DraNode) -> list[str]:
    return sorted(p.name for p in cache_root(node.host).iterdir() if p.name.startswith("d-"))


def share(
    node: DraNode, name: str, memory: str, cores: str | None = None, device: str = "gpu-0"
) -> Any:
    capacity = {"memory": memory, **({"cores": cores} if cores is not None else {})}
    return node.claim(name, {"request": "r", "device": device, "consumedCapacity": capacity})


def empty_tmpfs(node: DraNode) -> None:
    """What a reboot leaves of the node's tmpfs: the CDI directory and the cache root
    empty (the DaemonSet's init container mounts the cache tmpfs again, empty)."""
    for path in node.cdi.iterdir():
        path.unlink()
    for path in cache_root(node.host).iterdir():
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def reboot(node: DraNode) -> None:
    node.stop()
    empty_tmpfs(node)
    node.start()


def totals(node: DraNode) -> list[tuple[int | None, int | None]]:
    assert node.part is not None
    return sorted((c.memory_mib, c.cores) for claims in node.part.shares().values() for c in claims)


def test_a_reboot_gives_every_claim_its_spec_and_directories_back(dra: DraNode) -> None:  # noqa: F811
    dra.start()
    refs = [
        share(dra, "small", "1Gi", "30"),
        share(dra, "big", "8Gi", device="gpu-1"),
        dra.claim(
            "two-cards",
            {"request": "r", "device": "gpu-0", "consumedCapacity": {"memory": "2Gi"}},
            {"request": "r", "device": "gpu-1", "consumedCapacity": {"memory": "2Gi"}},
        ),
    ]
    first = dra.kubelet.prepare(refs)
    assert all(a.error == "" for a in first.values())
    written = {r[2]: spec_file(dra, r[2]).read_bytes() for r in refs}
    dirs, held = claim_dirs(dra), totals(dra)
    assert len(dirs) == 4
    (cache_root(dra.host) / dirs[0] / "vgpu.cache").write_bytes(b"a tenant's accounting")

    with capture_logs() as logs:
        reboot(dra)
    rebuilt = [e for e in logs if e["event"] == "claim_rebuilt"]
    assert sorted(e["uid"] for e in rebuilt) == sorted(r[2] for r in refs)  # one line each
    assert all(any(w.startswith("spec missing") for w in e["lost"]) for e in rebuilt)
    # at start already (the kubelet may not ask: a daemon restart alone), byte for byte
    assert {r[2]: spec_file(dra, r[2]).read_bytes() for r in refs} == written
    assert claim_dirs(dra) == dirs
    for name in dirs:  # made again as at first: empty, world-writable, in the private root
        path = cache_root(dra.host) / name
        assert list(path.iterdir()) == [] and oct(path.stat().st_mode & 0o777) == "0o777"
    # the kubelet's prepare after the reboot: the same answers, nothing counted twice
    with capture_logs() as logs:
        again = dra.kubelet.prepare(refs)
    assert again == first
    assert not [e for e in logs if e["event"] in ("claim_rebuilt", "claim_prepared")]
    assert totals(dra) == held
    # and the claims unprepare as ever
    assert dra.kubelet.unprepare(refs) == {r[2]: "" for r in refs}
    assert claim_dirs(dra) == [] and list(dra.cdi.iterdir()) == []


def test_a_prepare_rebuilds_what_went_while_the_daemon_ran(dra: DraNode) -> None:  # noqa: F811
    """The kubelet restarted (or the node rebooted while the daemon was not the one that
    tidied): the prepare itself finds the spec and the directory gone and makes them."""
    dra.start()
    ref = share(dra, "c", "3Gi", "40")
    (answer,) = dra.kubelet.prepare([ref]).values()
    written, dirs, held = spec_file(dra, ref[2]).read_bytes(), claim_dirs(dra), totals(dra)
    empty_tmpfs(dra)
    with capture_logs() as logs:
        (again,) = dra.kubelet.prepare([ref]).values()
    assert again == answer
    (event,) = [e for e in logs if e["event"] == "claim_rebuilt"]
    assert event["uid"] == ref[2] and event["claim"] == "default/c"
    assert event["lost"] == ["spec missing", f"cache directory {dirs[0]}"]
    assert spec_file(dra, ref[2]).read_bytes() == written
    assert claim_dirs(dra) == dirs and totals(dra) == held
    assert env_of(dra.spec(ref[2]))["CUDA_DEVICE_MEMORY_LIMIT_0"] == "3072m"


def test_a_spec_changed_on_disk_is_written_back_as_prepared(dra: DraNode) -> None:  # noqa: F811
    dra.start()
    ref = share(dra, "c", "1Gi")
    dra.kubelet.prepare([ref])
    path = spec_file(dra, ref[2])
    written = path.read_bytes()
    forged = json.loads(written)
    forged["devices"][0]["containerEdits"]["env"] = ["CUDA_DEVICE_MEMORY_LIMIT_0=99999m"]
    path.write_text(json.dumps(forged))
    with capture_logs() as logs:
        assert dra.kubelet.prepare([ref])[ref[2]].error == ""
    (event,) = [e for e in logs if e["event"] == "claim_rebuilt"]
    assert event["lost"] == ["spec changed"]
    assert path.read_bytes() == written


def test_an_entry_from_before_is_prepared_again_from_the_api_server(dra: DraNode) -> None:  # noqa: F811
    """An entry written before entries kept their spec: the claim is planned again (its
    allocation is the API server's, unchanged), with the same devices and limits."""
    dra.start()
    ref = share(dra, "c", "2Gi", "25")
    (answer,) = dra.kubelet.prepare([ref]).values()
    written, dirs = spec_file(dra, ref[2]).read_bytes(), claim_dirs(dra)
    dra.stop()
    entry = entry_file(dra, ref[2])
    data = json.loads(entry.read_text())
    del data["claim"]["spec"], data["claim"]["made"]
    entry.write_text(json.dumps(data))
    empty_tmpfs(dra)
    dra.start()
    assert not spec_file(dra, ref[2]).exists()  # nothing to rebuild it from at start
    with capture_logs() as logs:
        (again,) = dra.kubelet.prepare([ref]).values()
    assert again == answer
    events = [e["event"] for e in logs]
    assert "claim_host_side_lost" in events and "claim_prepared" in events
    assert spec_file(dra, ref[2]).read_bytes() == written
    assert claim_dirs(dra) == dirs
    assert "spec" in json.loads(entry.read_text())["claim"]  # the new entry keeps it


def test_a_spec_that_cannot_be_written_fails_that_claim_alone(dra: DraNode) -> None:  # noqa: F811
    dra.start()
    ref, other = share(dra, "c", "1Gi"), share(dra, "o", "1Gi", device="gpu-1")
    dra.kubelet.prepare([ref, other])
    empty_tmpfs(dra)
    spec_file(dra, ref[2]).mkdir()  # a directory where its spec must be written
    answers = dra.kubelet.prepare([ref, other])
    assert "cannot write the claim's CDI spec" in answers[ref[2]].error
    assert answers[other[2]].error == "" and spec_file(dra, other[2]).is_file()
    spec_file(dra, ref[2]).rmdir()
    assert dra.kubelet.prepare([ref])[ref[2]].error == ""  # the kubelet's retry
    assert spec_file(dra, ref[2]).is_file()


NAMES = itertools.count()


@pytest.fixture
def started(dra: DraNode) -> DraNode:  # noqa: F811
    dra.start()
    return dra


@settings(
    max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    memory_units=st.integers(min_value=1, max_value=96),
    cores=st.one_of(st.none(), st.integers(min_value=0, max_value=100)),
    device=st.sampled_from(["gpu-0", "gpu-1"]),
    lose=st.sampled_from(["spec", "dirs", "both"]),
)
def test_a_rebuilt_spec_is_the_one_first_written(
    started: DraNode, memory_units: int, cores: int | None, device: str, lose: str
) -> None:
    """For any share of a card, what a rebuild writes is byte for byte what the first
    prepare wrote, and the claim's directories come back where its spec mounts them."""
    node = started
    name = f"c{next(NAMES)}"
    asked = None if cores is None else str(cores)
    ref = share(node, name, f"{memory_units * 256}Mi", asked, device)
    (answer,) = node.kubelet.prepare([ref]).values()
    assert answer.error == ""
    path = spec_file(node, ref[2])
    written = path.read_bytes()
    devices = json.loads(written)["devices"]
    mounts = [m["hostPath"] for d in devices for m in d["containerEdits"].get("mounts", [])]
    keys = json.loads(entry_file(node, ref[2]).read_text())["claim"]["cache_keys"]
    if lose in ("spec", "both"):
        path.unlink()
    if lose in ("dirs", "both"):
        for key in keys:
            shutil.rmtree(cache_root(node.host) / key)
    assert node.kubelet.prepare([ref])[ref[2]] == answer
    assert path.read_bytes() == written
    assert all(Path(m).exists() for m in mounts)
    assert node.kubelet.unprepare([ref]) == {ref[2]: ""}
