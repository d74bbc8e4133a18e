"""Helpers for tests that run the daemon as a separate process and read its metrics."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from conftest import Node
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def poll(predicate: Callable[[], bool], timeout: float, step: float = 0.02) -> bool:
    """Re-check ``predicate`` until it holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(step)


def eventually(check: Callable[[], Any], timeout: float = 20.0, step: float = 0.02) -> Any:
    """``check()``'s first true result, re-checked until ``timeout`` passes (then fails)."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout} s: {check}")
        time.sleep(step)


def scrape(port: int, path: str = "/metrics") -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric_samples(text: str, name: str) -> list[dict[str, Any]]:
    """The samples named ``name`` in the exposition ``text``, each its labels and ``value``."""
    return [
        {**sample.labels, "value": sample.value}
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def daemon_samples(node: Node, name: str) -> list[dict[str, Any]]:
    """:func:`metric_samples` of what the node's in-process daemon exports now."""
    assert node.daemon is not None and node.daemon.metrics is not None
    return metric_samples(node.daemon.metrics.render().decode(), name)


def daemon_command(node: Node, *extra: str, port: int = 0) -> list[str]:
    """The ``gpushare-device-plugin`` command line for the node's files, JSON logs. The
    kubelet's device-plugin directory exists, as on a real node (the daemon checks it
    before waiting for the GPUs), whether or not a kubelet stand-in runs there."""
    s = node.settings
    Path(s.kubelet_dir).mkdir(parents=True, exist_ok=True)
    return [
        sys.executable,
        "-m",
        "gpushare.daemon",
        "--kubelet-dir",
        s.kubelet_dir,
        "--pod-resources-socket",
        s.pod_resources_socket,
        "--simulate",
        s.simulate,
        "--library",
        s.library,
        "--host-lib-dir",
        s.host_lib_dir,
        "--metrics-port",
        str(port),
        "--metrics-address",
        "127.0.0.1",
        "--log-format",
        "json",
        *extra,
    ]


def daemon_process(node: Node, port: int, *extra: str) -> subprocess.Popen[bytes]:
    """The daemon on the node's files, spread placement, metrics on ``port``."""
    command = daemon_command(node, "--placement", "spread", *extra, port=port)
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def reachable(port: int) -> bool:
    try:
        return scrape(port, "/healthz")[0] == 200
    except OSError:
        return False


def error_lines(stderr: str) -> list[str]:
    """What a command said on stderr besides its JSON log lines (the start line among them)."""
    return [line for line in stderr.strip().splitlines() if not line.startswith("{")]
