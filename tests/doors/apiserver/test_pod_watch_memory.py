"""The pod watch keeps what the daemon uses of a pod, nothing more.

A tenant's dead pods of about 1.4 MB each (long environment lists), bound to the node,
took the daemon from 45 MiB to 193 MiB against its 128 Mi limit: the watch kept whole
objects of every pod of the node and read each list answer whole. Now terminal pods are
left out by the field selector, the list is read in pages and one item at a time, and
each pod is reduced at once to the fields the daemon reads (non-GPU pods: nothing).

The API-server double runs in its own process (``gpushare.sim.bigpods``), so that
``tracemalloc`` here sees the daemon's side only. The big measurement (12 500 dead pods,
the daemon's RSS) is ``test_rss_with_12500_dead_pods`` (marker ``slow``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import TESLA_P4, Node, cards
from kit.procs import daemon_command, free_port, poll, scrape

from gpushare.bench.processes import end_on_stdin_close
from gpushare.kube.jsonstream import ListStream
from gpushare.kube.podslim import slim
from gpushare.kube.podspecs import PodSpecBook
from gpushare.kube.podwatch import PodWatch
from gpushare.kube.stdlibclient import ApiClient, kubeconfig_endpoint
from gpushare.share.devices import Resource
from gpushare.share.usage import Holder
from gpushare.sim.bigpods import big_pods

NODE = "gpu-node-1"
POD_BYTES = 1_400_000


class BigPods:
    def __init__(self, tmp: Path, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpushare.sim.bigpods", "--node", NODE, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.url = self.process.stdout.readline().strip()
        assert self.url.startswith("http://"), self.url
        self.kubeconfig = tmp / "kubeconfig"
        self.kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "c",
                    "clusters": [{"name": "c", "cluster": {"server": self.url}}],
                    "users": [{"name": "u", "user": {"token": "t"}}],
                    "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                }
            )
        )

    def stop(self) -> None:
        end_on_stdin_close(self.process)


@pytest.fixture
def crowded(short_tmp: Path) -> Iterator[BigPods]:
    served = BigPods(short_tmp, "--dead", "12", "--live", "3", "--gpu", "2")
    try:
        yield served
    finally:
        served.stop()


def test_a_list_of_large_pods_costs_one_pod_at_a_time_and_keeps_only_gpu_pods(
    crowded: BigPods,
) -> None:
    # What one such pod costs when parsed whole: the bound is a small multiple of it.
    one = json.dumps(next(big_pods(NODE, dead=1, live=0, gpu=0, size=POD_BYTES)))
    tracemalloc.start()
    json.loads(one)
    _current, one_parsed = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    one_cost = len(one) + one_parsed

    client = ApiClient(kubeconfig_endpoint(crowded.kubeconfig))
    book = PodSpecBook("gpushare.io")
    watch = PodWatch(lambda: client, NODE, book)
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        watch._list(client, 30.0)
        after, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        client.close()
    assert len(book) == 2
    assert book.requests_of(Holder("tenant", "gpu-0", "main")) == {
        Resource.MEMORY: 2,
        Resource.CORE: 0,
    }
    kept = watch._objects
    assert set(kept) == {
        p["metadata"]["uid"] for p in kept.values() if p["metadata"]["name"].startswith("gpu-")
    }
    assert all("env" not in json.dumps(p) for p in kept.values())
    # 17 pods of 1.4 MB were on the node (24 MB of JSON, about 100 MB parsed):
    assert after - before < 256 << 10, after - before  # kept: a few hundred bytes a pod
    assert peak - before < 2 * one_cost, (peak - before, one_cost)  # one pod at a time


def test_the_watch_drops_a_pod_that_ends_or_asks_no_gpu(short_tmp: Path) -> None:
    prefix = "gpushare.io"
    gpu = next(big_pods(NODE, dead=0, live=0, gpu=1, size=10_000))
    gpu["metadata"]["uid"] = "u1"
    gpu["metadata"]["annotations"] = {
        "gpushare.io/use-gputype": "A100",
        "nvidia.com/nouse-gpuuuid": "GPU-1",
        "other/huge": "x" * 100_000,
    }
    kept = slim(gpu, prefix)
    assert kept is not None
    assert kept["metadata"] == {
        "uid": "u1",
        "namespace": "tenant",
        "name": "gpu-0",
        "annotations": {
            "gpushare.io/use-gputype": "A100",
            "nvidia.com/nouse-gpuuuid": "GPU-1",
        },
    }
    assert kept["spec"]["containers"] == [
        {"name": "main", "resources": {"limits": {"gpushare.io/vcuda-memory": "2"}, "requests": {}}}
    ]
    assert len(json.dumps(kept)) < 1024
    assert slim({**gpu, "status": {"phase": "Failed"}}, prefix) is None
    assert slim(next(big_pods(NODE, dead=0, live=1, gpu=0, size=10_000)), prefix) is None
    zero = json.loads(json.dumps(gpu))
    zero["spec"]["containers"][0]["resources"]["limits"] = {"gpushare.io/vcuda-core": "0"}
    assert slim(zero, prefix) is None


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_the_list_reader_yields_each_item_and_the_list_fields(chunk: int) -> None:
    answer = {
        "kind": "PodList",
        "metadata": {"resourceVersion": "12", "continue": "12:5"},
        "items": [{"a": [1, 2.5, 'x\u00e9\\"']}, {}, 123456789, None, "s"],
        "apiVersion": "v1",
    }
    data = json.dumps(answer, ensure_ascii=False).encode()
    position = 0

    def read(size: int) -> bytes:
        nonlocal position
        piece = data[position : position + min(size, chunk)]
        position += len(piece)
        return piece

    stream = ListStream(read, chunk=chunk)
    assert list(stream.items()) == answer["items"]
    assert stream.fields == {k: v for k, v in answer.items() if k != "items"}


@pytest.mark.parametrize(
    "data", [b'{"items": [1, 2', b'{"items": [1 2]}', b"[1]", b'{"items": ["' + b"x" * 5000]
)
def test_a_truncated_or_oversized_answer_is_an_error(data: bytes) -> None:
    position = 0

    def read(size: int) -> bytes:
        nonlocal position
        piece = data[position : position + size]
        position += len(piece)
        return piece

    with pytest.raises(ValueError):
        list(ListStream(read, chunk=16, max_value=1000).items())


# -- the measurement ---------------------------------------------------------------------


def _rss_kib(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    hwm = int(re.search(r"VmHWM:\s+(\d+)", status).group(1))  # type: ignore[union-attr]
    return rss, hwm


def measure_daemon(short_tmp: Path, *served: str) -> dict[str, Any]:
    """Start the daemon (its own process, the API link on) against a crowded node; its
    RSS once it has listed the pods and served a while."""
    node = Node(short_tmp)
    node.write_gpus(cards(TESLA_P4, 2))
    node.kubelet.start()
    pods = BigPods(short_tmp, *served)
    port = free_port()
    env = {**os.environ, "KUBECONFIG": str(pods.kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    started = time.monotonic()
    log = short_tmp / "daemon.log"
    with log.open("w") as out:
        daemon = subprocess.Popen(
            daemon_command(node, "--node-name", NODE, "--log-level", "debug", port=port),
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        assert poll(lambda: "pods_listed" in log.read_text(), 3600, step=0.5), log.read_text()
        took = time.monotonic() - started
        assert poll(lambda: scrape(port, "/healthz")[0] == 200, 30)
        rss, hwm = _rss_kib(daemon.pid)
        return {"rss_mib": rss / 1024, "peak_mib": hwm / 1024, "seconds": took}
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
        pods.stop()
        node.kubelet.stop()


@pytest.mark.slow
def test_rss_with_12500_dead_pods(short_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """12 500 Failed non-GPU pods of 1.4 MB (17.5 GB of objects) plus 110 Running ones
    (a node's default maxPods, 154 MB, streamed through the reader and dropped)."""
    figures = {
        "idle": measure_daemon(short_tmp, "--dead", "0"),
        "12500 dead + 110 live 1.4 MB pods": measure_daemon(
            short_tmp, "--dead", "12500", "--live", "110", "--gpu", "2"
        ),
    }
    with capsys.disabled():
        for name, f in figures.items():
            print(
                f"\n{name}: RSS {f['rss_mib']:.1f} MiB, peak {f['peak_mib']:.1f} MiB, "
                f"listed after {f['seconds']:.1f} s"
            )
    assert all(f["peak_mib"] < 128 for f in figures.values())


def test_the_list_is_read_in_pages(
    api: Any, short_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gpushare.kube import podwatch

    monkeypatch.setattr(podwatch, "PAGE_LIMIT", 3)
    for i in range(7):
        pod = next(big_pods("gpu-node-1", dead=0, live=0, gpu=1, size=1000))
        pod["metadata"]["name"] = f"g{i}"
        api.add(pod)
    api.add(next(big_pods("gpu-node-1", dead=1, live=0, gpu=0, size=1000)))
    client = ApiClient(kubeconfig_endpoint(api.kubeconfig(short_tmp / "kubeconfig")))
    book = PodSpecBook("gpushare.io")
    watch = PodWatch(lambda: client, "gpu-node-1", book)
    try:
        watch._list(client, 10.0)
    finally:
        client.close()
    assert len(book) == 7
    lists = [r for r in api.calls("GET", "/api/v1/pods") if "watch" not in r.query]
    assert [r.query["limit"] for r in lists] == [["3"]] * 3
    assert "continue" not in lists[0].query and all("continue" in r.query for r in lists[1:])
    assert int(watch._resume) > 0
