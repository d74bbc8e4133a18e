"""The bench's ``driver`` tenants without a GPU or cgroup v2: a stand-in cgroup tree (a
directory with the root's ``cgroup.subtree_control``), a memory hook at the edge that
records what the runtime would hand it, and the stand-in driver.

What it shows: each tenant is in its own cgroup under the scratch parent before its
limit is set, its limit is set (the hook called with the card, the share and the
tenant's pid) before the tenant calls ``cuInit``, a crowd started at once as well; the dmem
controller enabled at the root for the run is disabled again; a hook that refuses
fails its tenants (killed, said), not the step's other work."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from kit.memhook import build_cuda

from gpushare.bench.gpu.plan import Backend, Settings, Step
from gpushare.bench.gpu.scenarios import Kernel, measure
from gpushare.bench.gpu.tenants import Context, tenancy

ROOT = Path(__file__).resolve().parents[3]
UUID = "GPU-2222cd7b-52eb-fd89-c0b1-ba91b23923dd"
DRIVER = Backend("driver", "driver (dmem)", "time-slicing", True, "")
#: A memory hook at the edge: it records its arguments, the OCI state and which cgroup
#: holds the state's pid at that moment, and exits with HOOK_EXIT.
HOOK = """#!{python}
import json, os, sys, time
state = json.load(sys.stdin)
root = {root!r}
where = [str(p.parent) for p in __import__("pathlib").Path(root).rglob("cgroup.procs")
         if p.read_text().strip() == str(state["pid"])]
record = {{"args": sys.argv[1:], "state": state, "cgroups": where, "at": time.monotonic()}}
with open(os.path.join({log!r}, f"{{state['id']}}.json"), "w") as out:
    json.dump(record, out)
if os.environ.get("HOOK_EXIT", "0") != "0":
    print("nvmlDeviceSetMemoryLimits_v1: Not Found", file=sys.stderr)
sys.exit(int(os.environ.get("HOOK_EXIT", "0")))
"""

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")


@pytest.fixture(scope="module")
def library(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("standin") / "libcuda.so.1"
    return build_cuda(out)


def world(tmp_path: Path) -> tuple[Context, Path, Path]:
    cgroup, log = tmp_path / "cgroup", tmp_path / "hook-log"
    cgroup.mkdir()
    log.mkdir()
    (cgroup / "cgroup.subtree_control").write_text("cpu memory\n")
    hook = tmp_path / "hook"
    hook.write_text(HOOK.format(python=sys.executable, root=str(cgroup), log=str(log)))
    hook.chmod(0o755)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    context = Context(uuid=UUID, share=50, share_mib=2048, scratch=scratch, hook=str(hook),
                      limits_backend="dmem", cgroup_root=cgroup)  # fmt: skip
    return context, cgroup, log


def kernel(library: Path) -> Kernel:
    return Kernel(str(library), Settings(seconds=0.1, warmup=0.0))


def test_each_tenant_is_in_its_cgroup_and_under_its_limit_before_cuinit(
    library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_LIMIT", str(8 << 30))
    context, cgroup, log = world(tmp_path)
    with tenancy(DRIVER, context) as driver:
        crowd = measure(driver, Step("start", "driver", 1, 8, 0.0), kernel(library), 2048)
        pair = measure(driver, Step("pair", "driver", 0, 2, 0.0), kernel(library), 2048)
        parent = driver.parent  # type: ignore[attr-defined]
    assert crowd.ok and pair.ok, (crowd, pair)
    assert len(crowd.hook_seconds) == 8 and len(pair.hook_seconds) == 2
    records = {p.stem: json.loads(p.read_text()) for p in log.iterdir()}
    assert set(records) == {f"start-1-{i}" for i in range(8)} | {"pair-0-a", "pair-0-b"}
    for name, record in records.items():
        assert record["args"] == ["--gpu", UUID, "--limit-mib", "2048"]
        assert record["state"]["status"] == "creating"
        assert record["cgroups"] == [str(parent / name)]  # its own, when its limit was set
    for tenant in crowd.tenants + pair.tenants:
        # released only once its limit was set, and only then into CUDA
        assert tenant.stages["main"] <= tenant.stages["gate"] <= tenant.stages["init"]
    assert (cgroup / "cgroup.subtree_control").read_text() == "-dmem"  # enabled, then undone
    assert (parent / "cgroup.subtree_control").read_text() == "+dmem"  # its leaves get dmem.*


def test_a_hook_that_refuses_fails_its_tenants_and_says_why(
    library: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STANDIN_LIMIT", str(8 << 30))
    monkeypatch.setenv("HOOK_EXIT", "1")
    context, _cgroup, _log = world(tmp_path)
    with tenancy(DRIVER, context) as driver:
        pair = measure(driver, Step("pair", "driver", 0, 2, 0.0), kernel(library), 2048)
    assert not pair.ok
    for tenant in pair.tenants:
        assert "not admitted: memory hook exit 1: nvmlDeviceSetMemoryLimits_v1" in tenant.error
        assert "init" not in tenant.stages and tenant.rate == 0.0  # never reached CUDA
