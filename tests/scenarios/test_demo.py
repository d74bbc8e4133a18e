"""``make demo``: what the container sees, one refusal, and no illusions."""

from __future__ import annotations

import subprocess
import sys


def test_the_demo_shows_the_merged_answer_a_refusal_and_that_nothing_is_enforced() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpushare.sim.demo"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
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
