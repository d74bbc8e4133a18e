"""``make demo``: what the container sees, one refusal, and no illusions.

The demo's entry point (``gpushare-demo``, :func:`gpushare.sim.demo.main`) is run in this
process: it starts the daemon and the kubelet stand-in in-process either way, and the
program started as a process is tests/daemon/test_version.py's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog

from gpushare.sim import demo


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """The demo configures structlog for its terminal (level error): put it back."""
    saved = structlog.get_config()
    try:
        yield
    finally:
        structlog.configure(**saved)


def test_the_demo_shows_the_merged_answer_a_refusal_and_that_nothing_is_enforced(
    restored_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    assert demo.main([]) == 0
    out = capsys.readouterr().out
    # the merged view: both resources' envs in one block per container
    block = out.split("pod-a/main:", 1)[1].split("pod-b/main:", 1)[0]
    assert "what the container sees (merged from the answers for" in block
    for env in ("CUDA_DEVICE_MEMORY_LIMIT_0=1024m", "CUDA_DEVICE_SM_LIMIT=10", "LD_PRELOAD="):
        assert f"env   {env}" in block
    assert block.count("NVIDIA_VISIBLE_DEVICES=") == 1
    assert "CONFLICT" not in out
    assert "pod-d/main: 10 memory units + 10 core units -> NOT admitted" in out
    assert "the pod fails with: UnexpectedAdmissionError: a container must stay on one GPU" in out
    assert "nothing above is enforced" in out
