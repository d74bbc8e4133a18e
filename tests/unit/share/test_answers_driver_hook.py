"""What the answer port makes of a share on a card whose memory is the driver's: the
createRuntime hook with the card and the limit in its arguments (never the environment),
nothing for libvgpu to count, the interposer kept only for a compute limit it holds."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpushare.share import answers
from gpushare.share.answers import DriverHook, Enforcement

CARD = "GPU-aaaa"
HOOK = DriverHook("/usr/local/vgpu/gpushare-memory-hook.0123", ("--nvml-lib", "/x.so"), ("A=b",))


def enforcement(memory: str = "driver", compute: str = "interposer") -> Enforcement:
    return Enforcement(
        library=Path("/usr/local/vgpu/libvgpu.so.1"),
        preload_file=None,
        use_ld_preload_env=True,
        memory={CARD: memory} if memory != "interposer" else {},
        compute={CARD: compute} if compute != "interposer" else {},
        driver_hook=HOOK,
    )


@given(memory=st.integers(1, 1 << 20), cores=st.none() | st.integers(1, 100),
       compute=st.sampled_from(["interposer", "none"]))  # fmt: skip
def test_a_driver_share_carries_its_limit_in_the_hooks_arguments(
    memory: int, cores: int | None, compute: str
) -> None:
    grant = answers.share(CARD, enforcement=enforcement(compute=compute), memory_mib=memory,
                          cores=cores, cache_dir=Path("/c"))  # fmt: skip
    edits = answers.container_edits(grant)
    (hook,) = edits.hooks
    assert hook.hook_name == "createRuntime" and hook.path == HOOK.path
    assert hook.args == ("gpushare-memory-hook.0123", "--gpu", CARD, "--limit-mib", str(memory),
                         "--nvml-lib", "/x.so")  # fmt: skip
    assert hook.env == ("A=b",)  # the daemon's, never the limit
    assert answers.MEMORY_LIMIT not in edits.envs and answers.SHARED_CACHE not in edits.envs
    assert all(m.container_path != answers.CONTAINER_CACHE_DIR for m in edits.mounts)
    interposed = any(m.container_path == answers.CONTAINER_LIBRARY for m in edits.mounts)
    assert interposed == (compute == "interposer")
    assert (answers.CORE_LIMIT in edits.envs) == (compute == "interposer" and cores is not None)


def test_a_core_answer_on_a_driver_card_has_no_hook() -> None:
    edits = answers.container_edits(answers.share(CARD, enforcement=enforcement(), cores=30))
    assert edits.hooks == [] and edits.envs[answers.CORE_LIMIT] == "30"


def test_an_interposer_card_is_as_before() -> None:
    grant = answers.share(CARD, enforcement=enforcement("interposer"), memory_mib=512,
                          cache_dir=Path("/c"))  # fmt: skip
    edits = answers.container_edits(grant)
    assert edits.hooks == [] and edits.envs[answers.MEMORY_LIMIT] == "512m"


def test_a_driver_card_without_an_installed_hook_is_an_error() -> None:
    broken = Enforcement(None, None, False, memory={CARD: "driver"})
    with pytest.raises(ValueError, match="no hook is installed"):
        answers.container_edits(answers.share(CARD, enforcement=broken, memory_mib=1))
