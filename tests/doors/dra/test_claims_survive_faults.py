"""Issue 32, items 5 to 9: the DRA driver under faults, over the real sockets (the DRA
kubelet stand-in, the API-server double). Nothing a running claim uses is removed, one
claim's broken file never holds up another claim, and nothing blocks under the node
lock."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest
from kit.procs import eventually
from test_dra_plugin import DRIVER, DraNode, dra, env_of  # noqa: F401  (dra: the fixture)

from gpushare.host.library import cache_root


def spec_file(node: DraNode, uid: str) -> Path:
    return node.cdi / f"{DRIVER}-claim_{uid}.json"


def entry_file(node: DraNode, uid: str) -> Path:
    return node.host / "dra" / "claims" / f"{uid}.json"


def claim_dirs(node: DraNode) -> list[str]:
    return sorted(p.name for p in cache_root(node.host).iterdir() if p.name.startswith("d-"))


def claim_reads(node: DraNode) -> list[str]:
    """The claim reads that reached the held API server, in order."""
    return [p for p in list(node.api.held_paths) if "/resourceclaims/" in p]


def shared(node: DraNode, name: str, memory: str = "1Gi", device: str = "gpu-0") -> Any:
    return node.claim(
        name, {"request": "r", "device": device, "consumedCapacity": {"memory": memory}}
    )


# ------------------------------------------------------------------ 5: a torn entry
def test_a_zero_length_entry_is_recovered_and_tidying_goes_on(dra: DraNode) -> None:  # noqa: F811
    dra.start()
    refs = [shared(dra, f"c{i}") for i in range(3)]
    first = dra.kubelet.prepare(refs)
    torn = refs[0]
    dra.stop()
    entry_file(dra, torn[2]).write_bytes(b"")  # as a power cut leaves an unsynced entry
    leftover = cache_root(dra.host) / "d-00000000000000000000"
    leftover.mkdir()  # a directory a killed prepare made and no spec names
    dra.start()
    assert not leftover.exists()  # tidying was not stopped by the torn entry
    assert dra.part is not None
    assert len(dra.part.preparer.held.entries()) == 3  # the torn one recovered from its spec
    # its claim prepares again with the same answer and limit, and unprepares
    again = dra.kubelet.prepare([torn])
    assert again[torn[2]] == first[torn[2]]
    assert env_of(dra.spec(torn[2]))["CUDA_DEVICE_MEMORY_LIMIT_0"] == "1024m"
    assert dra.kubelet.unprepare([torn]) == {torn[2]: ""}
    assert not spec_file(dra, torn[2]).exists()
    assert dra.kubelet.unprepare(refs[1:]) == {r[2]: "" for r in refs[1:]}
    assert claim_dirs(dra) == [] and list(dra.cdi.iterdir()) == []


# ------------------------------------------------------------------ 6: a lost checkpoint
@pytest.mark.parametrize("how", ["emptied", "moved"])
def test_a_lost_checkpoint_keeps_every_running_claim(
    dra: DraNode,  # noqa: F811
    how: str,
) -> None:
    dra.start()
    refs = [shared(dra, f"c{i}", "512Mi", f"gpu-{i % 2}") for i in range(6)]
    dra.kubelet.prepare(refs)
    specs, dirs = sorted(p.name for p in dra.cdi.iterdir()), claim_dirs(dra)
    assert len(specs) == 6 and len(dirs) == 6
    dra.stop()
    if how == "emptied":
        for entry in (dra.host / "dra" / "claims").iterdir():
            entry.unlink()
    else:
        from dataclasses import replace

        dra.settings = replace(dra.settings, dra_state_dir=str(dra.root / "elsewhere"))
    dra.start()
    assert sorted(p.name for p in dra.cdi.iterdir()) == specs  # nothing of theirs removed
    assert claim_dirs(dra) == dirs
    assert dra.part is not None
    shares = dra.part.shares()  # still shown as held, with their limits
    assert sorted(c.memory_mib for claims in shares.values() for c in claims) == [512] * 6
    # each claim's unprepare (the kubelet's word that it ended) removes what it holds
    for ref in refs:
        assert dra.kubelet.unprepare([ref]) == {ref[2]: ""}
        assert not spec_file(dra, ref[2]).exists()
    assert claim_dirs(dra) == [] and list(dra.cdi.iterdir()) == []


def test_unprepare_of_a_claim_with_no_entry_removes_what_its_spec_names(
    dra: DraNode,  # noqa: F811
) -> None:
    dra.start()
    ref = shared(dra, "c")
    dra.kubelet.prepare([ref])
    entry_file(dra, ref[2]).unlink()  # lost while the daemon runs
    assert dra.kubelet.unprepare([ref]) == {ref[2]: ""}
    assert not spec_file(dra, ref[2]).exists() and claim_dirs(dra) == []


# ------------------------------------------------------------------ 7: a planted directory
def test_a_directory_named_like_a_spec_never_fails_the_start(dra: DraNode) -> None:  # noqa: F811
    planted = dra.cdi / f"{DRIVER}-claim_0123abcd-0000-0000-0000-000000000000.json"
    planted.mkdir(parents=True)
    (dra.cdi / f"{DRIVER}-claim_bad.json").parent.mkdir(exist_ok=True)
    os.mkfifo(dra.cdi / f"{DRIVER}-claim_fifo-0000.json")
    dra.start()  # IsADirectoryError here before
    ref = shared(dra, "c")
    (answer,) = dra.kubelet.prepare([ref]).values()
    assert answer.error == ""
    uid = planted.name.removeprefix(f"{DRIVER}-claim_").removesuffix(".json")
    assert dra.kubelet.unprepare([("default", "x", uid)]) == {uid: ""}
    assert planted.is_dir()  # not ours: left, reported


# ------------------------------------------------------------------ 8: links and FIFOs
def test_a_fifo_in_place_of_an_entry_never_blocks_the_node_lock(dra: DraNode) -> None:  # noqa: F811
    dra.start()
    ref, other = shared(dra, "c"), shared(dra, "o", device="gpu-1")
    first = dra.kubelet.prepare([ref])
    entry = entry_file(dra, ref[2])
    entry.unlink()
    os.mkfifo(entry)  # a read would block forever, holding the node lock
    again = dra.kubelet.prepare([ref], timeout=60)
    assert again[ref[2]].error == "" and again[ref[2]].devices == first[ref[2]].devices
    assert dra.kubelet.prepare([other])[other[2]].error == ""  # the lock is free
    assert dra.kubelet.unprepare([ref, other]) == {ref[2]: "", other[2]: ""}


def test_a_link_in_place_of_an_entry_is_not_followed(dra: DraNode) -> None:  # noqa: F811
    dra.start()
    ref = shared(dra, "c")
    dra.kubelet.prepare([ref])
    entry = entry_file(dra, ref[2])
    forged = dra.root / "forged.json"
    data = json.loads(entry.read_text())
    data["claim"]["name"] = "someone-else"
    forged.write_text(json.dumps(data))
    entry.unlink()
    entry.symlink_to(forged)
    (answer,) = dra.kubelet.prepare([ref]).values()
    assert answer.error == ""  # recovered from the spec, not refused as someone else's
    assert not entry.is_symlink()
    assert json.loads(forged.read_text())["claim"]["name"] == "someone-else"  # untouched


# ------------------------------------------------------------------ 9: a hung API server
def test_a_hung_api_server_never_holds_up_an_unprepare(dra: DraNode) -> None:  # noqa: F811
    dra.start()
    held = shared(dra, "held")
    dra.kubelet.prepare([held])
    waiting = shared(dra, "waiting", device="gpu-1")
    answers: dict[str, Any] = {}
    dra.api.hold()
    try:
        worker = threading.Thread(
            target=lambda: answers.update(dra.kubelet.prepare([waiting], timeout=60))
        )
        worker.start()
        eventually(lambda: claim_reads(dra))  # its claim read hangs in the API server
        assert dra.kubelet.unprepare([held]) == {held[2]: ""}
        assert worker.is_alive()  # the unprepare did not wait for it
    finally:
        dra.api.release()
    worker.join(60)
    assert answers[waiting[2]].error == ""


def test_a_prepare_past_the_kubelets_deadline_reads_no_further_claims(
    dra: DraNode,  # noqa: F811
) -> None:
    dra.start()
    refs = [shared(dra, f"c{i}") for i in range(3)]
    late = shared(dra, "late", device="gpu-1")
    dra.api.hold()
    answers: dict[str, Any] = {}
    try:
        try:  # the daemon gives up at the deadline too: either side may end the call
            answered = dra.kubelet.prepare(refs, timeout=1.0)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        else:
            assert all(a.error for a in answered.values()), answered
        worker = threading.Thread(
            target=lambda: answers.update(dra.kubelet.prepare([late], timeout=60))
        )
        worker.start()
        paths = eventually(lambda: p if len(p := claim_reads(dra)) >= 2 else None, 60.0)
        # the next claim read is the new call's: the expired call read no further claims
        assert paths[0].endswith("/c0") and paths[1].endswith("/late"), paths
    finally:
        dra.api.release()
    worker.join(60)
    assert answers[late[2]].error == ""
    assert not any(spec_file(dra, r[2]).exists() for r in refs)


# ------------------------------------------------------------------ 4: the unit changes
def test_a_unit_change_never_over_commits_a_card(dra: DraNode) -> None:  # noqa: F811
    """96 claims of 256 MiB on a 24 576 MiB card, allocated under 256 MiB units, half of
    them prepared before the daemon restarts with 1024 MiB units, half after."""
    from dataclasses import replace

    dra.settings = replace(dra.settings, memory_unit_mib=256)
    dra.start()
    refs = [shared(dra, f"c{i}", "256Mi") for i in range(96)]
    before = dra.kubelet.prepare(refs[:48])
    dra.stop()
    dra.settings = replace(dra.settings, memory_unit_mib=1024)
    dra.start()
    assert dra.kubelet.prepare(refs[:48]) == before  # prepared claims keep their answers
    after = dra.kubelet.prepare(refs[48:])
    assert all(a.error == "" for a in after.values())
    limits = [env_of(dra.spec(r[2]))["CUDA_DEVICE_MEMORY_LIMIT_0"] for r in refs]
    assert set(limits) == {"256m"}  # what each was charged, never the new unit
    assert sum(int(v.removesuffix("m")) for v in limits) <= dra.gpus[0].memory_mib
    assert dra.part is not None
    shown = [c.memory_mib for c in dra.part.shares()[dra.gpus[0].uuid]]
    assert sum(m or 0 for m in shown) == 96 * 256
