"""make gpu-bench's pieces on a real card (``pytest -m gpu``; skipped without a driver).

The facts are read from the real nvidia-smi, the plan finds the card and at least
time-slicing; the tenant worker runs the probe's kernel through the real driver (its
stages in order, a positive rate); and two time-sliced tenants share the card: each
gets clearly less than one alone, together not much less than one alone. Nothing here
changes a GPU setting.
"""

from __future__ import annotations

import ctypes
import shutil
import tempfile
from pathlib import Path

import pytest

from gpushare.bench.gpu import facts as f
from gpushare.bench.gpu import plan as p
from gpushare.bench.gpu.scenarios import Kernel, measure
from gpushare.bench.gpu.tenants import Context, tenancy


def _libcuda() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _libcuda(), reason="no NVIDIA driver (libcuda.so.1) here"),
    pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no nvidia-smi here"),
]

SETTINGS = p.Settings(runs=1, seconds=2.0, warmup=1.0, crowd=4)


def _plan() -> tuple[f.Facts, p.Plan]:
    facts = f.gather("/nonexistent/libvgpu.so", "/nonexistent/hook")
    return facts, p.decide(facts, SETTINGS)


def test_the_real_card_is_read_and_time_slicing_is_planned() -> None:
    facts, plan = _plan()
    assert plan.card is not None, facts.smi_error
    assert plan.card.uuid.startswith(("GPU-", "MIG-")) and plan.card.memory_mib > 0
    assert f.driver_major(plan.card.driver) is not None
    if plan.card.mig != "Enabled":
        assert "time-sliced" in {b.name for b in plan.present}
    assert "absent" in p.render(plan, facts) or len(plan.present) == len(p.BACKENDS)


def test_two_time_sliced_tenants_share_the_card() -> None:
    _facts, plan = _plan()
    assert plan.card is not None
    if plan.card.mig == "Enabled":
        pytest.skip("MIG mode is on (never changed here)")
    context = Context(uuid=plan.card.uuid, share=50, share_mib=plan.share_mib,
                      scratch=Path(tempfile.mkdtemp(prefix="gpushare-bench-test-")))  # fmt: skip
    kernel = Kernel("libcuda.so.1", SETTINGS)
    sliced = next(b for b in plan.backends if b.name == "time-sliced")
    with tenancy(None, context) as plain:
        alone = measure(plain, p.Step("dedicated", "none", 0, 1, 0.0), kernel, plan.share_mib)
        start = measure(plain, p.Step("start", "none", 1, 4, 0.0), kernel, plan.share_mib)
    with tenancy(sliced, context) as shared:
        pair = measure(shared, p.Step("pair", "time-sliced", 0, 2, 0.0), kernel, plan.share_mib)
    assert alone.ok and pair.ok and start.ok, (alone, pair, start)
    dedicated = alone.rates[0]
    assert dedicated > 0
    for tenant in start.tenants:
        order = [tenant.stages[s] for s in ("main", "init", "context", "module", "first_kernel")]
        assert order == sorted(order)
    a, b = pair.rates
    assert a < 0.75 * dedicated and b < 0.75 * dedicated  # each gives up part of the card
    assert a + b > 0.5 * dedicated  # and together they keep most of it
