"""What the NVML reference says about the memory-limit setter, held by the hook (C) and the
daemon (Python) alike (issue 41 item 5): a limit above the card's total is refused by NVML
(INVALID_ARGUMENT), so neither side asks for one (a grant is held to the card's total);
OPERATING_SYSTEM means the cgroup is gone or not visible to the driver; NOT_FOUND on the
dmem backend means a level above the cgroup does not enable ``+dmem``; a read-back of
NOT_SUPPORTED after a set that succeeded means the limit is not enforced. The stand-in NVML
(tests/kit/standin/libnvml_standin.c) answers as the reference says; each answer's words
are the same in the hook's line and in the daemon's self-test reason."""

from __future__ import annotations

from pathlib import Path

import pytest
from kit.memhook import HAVE_GCC, UUID, HookWorld, build, oci_state

from gpushare.gpu.memlimits import (
    MEANINGS,
    NVML_ERROR_INVALID_ARGUMENT,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_OPERATING_SYSTEM,
    READBACK_UNSUPPORTED,
    LimitStore,
    MemoryLimitError,
    MemoryLimits,
)
from gpushare.node.backendfacts import self_test
from gpushare.share.answers import DriverHook, Enforcement, driver_hook

pytestmark = pytest.mark.skipif(not HAVE_GCC, reason="needs gcc")
CARD_MIB = 16384


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return build(tmp_path_factory.mktemp("hook"))


def world(built: tuple[Path, Path], tmp_path: Path, mode: str = "ok") -> HookWorld:
    hook, nvml = built
    here = HookWorld(tmp_path, hook, nvml)
    here.store.publish("615.20.01", {UUID: mode}, {UUID: CARD_MIB << 20})
    return here


def test_a_limit_above_the_cards_total_is_held_to_the_total(
    built: tuple[Path, Path], tmp_path: Path
) -> None:
    here = world(built, tmp_path)
    namespace = here.container(41, "/kubepods/pod-a/c")
    result = here.run(oci_state(41), args=here.args(limit_mib=CARD_MIB + 1024))
    assert result.returncode == 0, result.stderr
    assert "limited to the card's total" in result.stderr
    assert here.store.get_memory_limits(UUID, namespace) == MemoryLimits(0, CARD_MIB << 20)
    # the daemon never names more than the card either
    enforcement = Enforcement(None, None, False, driver_hook=DriverHook("/h/gpushare-memory-hook"),
                              card_memory_mib={UUID: CARD_MIB})  # fmt: skip
    args = driver_hook(enforcement, UUID, CARD_MIB * 2).args
    assert args[args.index("--limit-mib") + 1] == str(CARD_MIB)
    assert driver_hook(enforcement, UUID, 512).args[4] == "512"
    # and the simulated driver refuses one above, as NVML does
    with pytest.raises(MemoryLimitError) as refused:
        here.store.set_memory_limits(UUID, namespace, 0, (CARD_MIB + 1) << 20)
    assert refused.value.code == NVML_ERROR_INVALID_ARGUMENT


@pytest.mark.parametrize(
    "mode, code", [("gone", NVML_ERROR_OPERATING_SYSTEM), ("dmem", NVML_ERROR_NOT_FOUND)]
)
def test_the_hook_and_the_self_test_say_what_the_answer_means(
    built: tuple[Path, Path], tmp_path: Path, mode: str, code: int
) -> None:
    here = world(built, tmp_path, mode)  # dmem: no level of the stand-in tree enables it
    here.container(42, "/kubepods/pod-b/c")
    result = here.run(oci_state(42), args=here.args(limit_mib=512))
    assert result.returncode == 1
    assert result.stderr.rstrip().endswith(f"({code}): {MEANINGS[code]}"), result.stderr
    assert f"{MEANINGS[code]}" in self_test(LimitStore(here.store.path), UUID, here.cgroup)


def test_a_read_back_of_not_supported_after_a_set_is_not_enforced(
    built: tuple[Path, Path], tmp_path: Path
) -> None:
    here = world(built, tmp_path, "broken")  # the set succeeds, nothing is held
    here.container(43, "/kubepods/pod-c/c")
    result = here.run(oci_state(43), args=here.args(limit_mib=512))
    assert result.returncode == 1 and READBACK_UNSUPPORTED in result.stderr
    assert READBACK_UNSUPPORTED in self_test(LimitStore(here.store.path), UUID, here.cgroup)


def test_every_meaning_is_the_same_words_in_the_hooks_source() -> None:
    """Every answer the daemon explains, the hook explains in the same words (its
    ``explain`` switch), and no other."""
    import re

    source = (Path(__file__).resolve().parents[3] / "hook" / "memory-hook.c").read_text()
    body = source.split("static const char *explain(", 1)[1].split("default:", 1)[0]
    in_c = {int(code): text for code, text in re.findall(r'case (\d+): return ": ([^"]+)";', body)}
    assert in_c == MEANINGS
