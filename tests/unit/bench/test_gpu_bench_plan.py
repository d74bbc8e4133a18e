"""make gpu-bench's decisions without a GPU: the machine's facts parsed from recorded
text (nvidia-smi, dmem.capacity, mounts, the driver's params), and the plan per
detected backend: each backend present or absent with its reason, its steps, and the
whole inside the time a device call allows."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given
from hypothesis import strategies as st

from gpushare.bench.gpu import facts as f
from gpushare.bench.gpu import plan as p

#: What nvidia-smi printed on the H200 of docs/gpu-proof.md (2026-11-27), in the query's
#: order, and on an H100 lent the same month.
H200_R580 = (
    "0, GPU-1081cd7b-52eb-fd89-c0b1-ba91b23923dd, NVIDIA H200, 580.159.04, 143771, "
    "Disabled, Enabled, Default, 00000000:19:00.0\n"
)
H100_R615 = (
    "0, GPU-2222cd7b-52eb-fd89-c0b1-ba91b23923dd, NVIDIA H100 80GB HBM3, 615.41.02, 81559, "
    "Disabled, Disabled, Default, 00000000:1A:00.0\n"
)
DMEM = "nvidia/0000:1a:00.0/vidmem 85520809984\nsystem/ram 0\n"
MOUNTS = (
    "sysfs /sys sysfs rw 0 0\n"
    "tmpfs /sys/fs/cgroup tmpfs ro 0 0\n"
    "cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n"
)
MPS_HELP = "  -d,--daemon              Setup the daemon\n  -M,--multiuser-server    Enable"
MPS_V3 = "server commands: server create\nnamespace commands: namespace create"


def machine(smi: str = H200_R580, **changes: object) -> f.Facts:
    base = f.Facts(
        cards=f.parse_smi(smi),
        cgroup_fs="cgroup2fs",
        mps_control="/usr/bin/nvidia-cuda-mps-control",
        mps_help=MPS_HELP,
        interposer="/repo/.gpu-bench/libvgpu.so",
        interposer_check="check-interposer: x exports every required hook (465 CUDA/NVML)",
        hook="/repo/.gpu-bench/gpushare-memory-hook",
        gcc=True,
        root=True,
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def by_name(plan: p.Plan) -> dict[str, p.Backend]:
    return {b.name: b for b in plan.backends}


# -- facts from recorded text -------------------------------------------------------------


def test_nvidia_smi_csv_is_read_into_cards_and_junk_lines_are_skipped() -> None:
    text = "index, uuid, name\nNVIDIA-SMI has failed\n" + H200_R580 + H100_R615
    cards = f.parse_smi(text)
    assert [c.name for c in cards] == ["NVIDIA H200", "NVIDIA H100 80GB HBM3"]
    h200 = cards[0]
    assert (h200.uuid, h200.driver, h200.memory_mib, h200.mig) == (
        "GPU-1081cd7b-52eb-fd89-c0b1-ba91b23923dd", "580.159.04", 143771, "Disabled"
    )  # fmt: skip
    assert (h200.persistence, h200.compute_mode, h200.bus_id) == (
        "Enabled", "Default", "00000000:19:00.0"
    )  # fmt: skip
    assert f.parse_smi("") == ()


def test_driver_major() -> None:
    assert f.driver_major("580.159.04") == 580
    assert f.driver_major("615.41.02") == 615
    assert f.driver_major("[N/A]") is None


def test_dmem_capacity_mounts_and_the_drivers_registry_keys() -> None:
    assert f.parse_dmem_capacity(DMEM) == {
        "nvidia/0000:1a:00.0/vidmem": 85520809984,
        "system/ram": 0,
    }
    assert f.parse_dmem_capacity("garbage line here\n") == {}
    assert f.parse_cgroup_fs(MOUNTS) == "cgroup2fs"  # the last mount there is what is seen
    assert f.parse_cgroup_fs("tmpfs /sys/fs/cgroup tmpfs ro 0 0\n") == "tmpfs"
    assert f.parse_cgroup_fs("") == ""
    params = 'ResmanDebugLevel: 4294967295\nRegistryDwords: "RmMemacctMode=2;RMFoo=1"\n'
    assert f.parse_memacct_mode(params) == "dmem"
    assert f.parse_memacct_mode('RegistryDwords: "RmMemacctMode=0x1"') == "misc"
    assert f.parse_memacct_mode('RegistryDwords: ""') == ""
    assert f.parse_memacct_mode("") == ""


def test_which_memory_limit_backend_the_driver_has() -> None:
    assert machine().limits_backend == ""  # r580: none
    assert machine(H100_R615, dmem_capacity=f.parse_dmem_capacity(DMEM)).limits_backend == "dmem"
    assert machine(H100_R615).limits_backend == "misc"  # no dmem lines: the driver's own map
    assert machine(H100_R615, memacct_mode="off").limits_backend == ""
    assert machine(H100_R615, memacct_mode="misc",
                   dmem_capacity=f.parse_dmem_capacity(DMEM)).limits_backend == "misc"  # fmt: skip


def test_mps_help_says_multi_user_and_namespaces() -> None:
    assert machine().mps_multi_user and not machine().mps_namespaces
    assert machine(mps_v3_help=MPS_V3).mps_namespaces
    assert not machine(mps_help="  -d,--daemon").mps_multi_user


# -- the plan -----------------------------------------------------------------------------


def test_the_h200_of_november_measures_three_backends_and_says_why_not_the_driver() -> None:
    plan = p.decide(machine())
    backends = by_name(plan)
    assert [b.name for b in plan.present] == ["time-sliced", "interposer", "interposer-memory",
                                              "mps"]  # fmt: skip
    assert backends["driver"].reason == "driver 580.159.04 is older than r615"
    assert "older than r615" in backends["driver+mps"].reason
    assert backends["mps"].reason.startswith("legacy protocol")
    assert plan.share_mib == 143771 // 2


def test_a_r615_machine_with_dmem_and_mps_v3_measures_all_six() -> None:
    facts = machine(H100_R615, dmem_capacity=f.parse_dmem_capacity(DMEM), mps_v3_help=MPS_V3)
    plan = p.decide(facts)
    assert [b.name for b in plan.present] == list(p.BACKENDS)
    backends = by_name(plan)
    assert backends["driver"].memory == "driver (dmem)"
    assert backends["driver+mps"].compute == "MPS active threads"
    assert backends["mps"].memory == "MPS pinned limit (namespace)"
    assert plan.total_seconds <= p.BUDGET_S


def test_absent_backends_name_what_is_missing() -> None:
    r615 = machine(H100_R615)
    cases = {
        "no libvgpu.so (scripts/gpu-bench-prepare.sh builds it)": (
            machine(interposer=""), "interposer"),
        "libvgpu.so refused: check-interposer: x exports 1 CUDA/NVML functions but not: cuInit": (
            machine(interposer_check="check-interposer: x exports 1 CUDA/NVML functions "
                    "but not: cuInit"), "interposer"),
        "no nvidia-cuda-mps-control on PATH": (machine(mps_control=""), "mps"),
        "no cgroup v2 at /sys/fs/cgroup (tmpfs there)": (
            replace(r615, cgroup_fs="tmpfs"), "driver"),
        "the driver's memory accounting is off (RmMemacctMode=0)": (
            replace(r615, memacct_mode="off"), "driver"),
        "not root: cannot make cgroups or set limits": (replace(r615, root=False), "driver"),
        "no memory hook program and no gcc to build it from hook/memory-hook.c": (
            replace(r615, hook="", gcc=False), "driver"),
    }  # fmt: skip
    for reason, (facts, name) in cases.items():
        backends = by_name(p.decide(facts))
        assert not backends[name].present
        assert backends[name].reason == reason
        if name == "interposer":  # its memory-only twin needs the same library
            assert backends["interposer-memory"].reason == reason
    no_mps = by_name(p.decide(replace(r615, mps_control="")))
    assert no_mps["driver"].present
    assert no_mps["driver+mps"].reason == "no nvidia-cuda-mps-control on PATH"


def test_no_card_or_mig_on_means_nothing_runs_and_says_so() -> None:
    nothing = p.decide(f.Facts(smi_error="no nvidia-smi on PATH"))
    assert not nothing.present and not nothing.steps
    assert {b.reason for b in nothing.backends} == {"no GPU (no nvidia-smi on PATH)"}
    mig = p.decide(machine(H200_R580.replace("Disabled", "Enabled")))
    assert not mig.present and not mig.steps
    assert all("MIG mode is on" in b.reason for b in mig.backends)


def test_dry_run_text_names_the_facts_and_every_backend() -> None:
    facts = machine()
    text = p.render(p.decide(facts), facts)
    assert "NVIDIA H200" in text and "driver 580.159.04" in text and "MIG Disabled" in text
    assert "backend driver: absent: driver 580.159.04 is older than r615" in text
    assert "backend time-sliced: present" in text
    assert "steps: " in text


@st.composite
def machines(draw: st.DrawFn) -> f.Facts:
    smi = draw(st.sampled_from([H200_R580, H100_R615, H100_R615.replace("615.", "620."),
                                H200_R580.replace("Disabled", "Enabled"), ""]))  # fmt: skip
    return machine(
        smi,
        cgroup_fs=draw(st.sampled_from(["cgroup2fs", "tmpfs", ""])),
        dmem_capacity=draw(st.sampled_from([{}, f.parse_dmem_capacity(DMEM)])),
        memacct_mode=draw(st.sampled_from(["", "off", "misc", "dmem", "auto"])),
        mps_control=draw(st.sampled_from(["", "/usr/bin/nvidia-cuda-mps-control"])),
        mps_v3_help=draw(st.sampled_from(["", MPS_V3])),
        interposer=draw(st.sampled_from(["", "/x/libvgpu.so"])),
        hook=draw(st.sampled_from(["", "/x/hook"])),
        gcc=draw(st.booleans()),
        root=draw(st.booleans()),
    )


@given(machines(), st.integers(1, 3), st.integers(1, 20))
def test_every_plan_lists_each_backend_once_and_fits_the_device_call(
    facts: f.Facts, runs: int, crowd: int
) -> None:
    settings = p.Settings(runs=runs, crowd=crowd)
    plan = p.decide(facts, settings)
    assert [b.name for b in plan.backends] == list(p.BACKENDS)
    for backend in plan.backends:
        steps = [s for s in plan.steps if s.backend == backend.name]
        if not backend.present:
            assert backend.reason and not steps
            continue
        scenarios = [s.scenario for s in steps]
        assert scenarios.count("pair") == runs
        assert scenarios.count("alone") == settings.alone_runs
        assert scenarios.count("pressure") == settings.pressure_runs
        assert sorted(s.tenants for s in steps if s.scenario == "start") == sorted([1, crowd])
        assert all(s.tenants == 2 for s in steps if s.scenario in ("pair", "pressure"))
    if plan.present:
        assert [s.scenario for s in plan.steps].count("dedicated") == runs
        assert plan.steps[-1].scenario == "control"
    # driver+mps only where both of its halves are
    names = {b.name for b in plan.present}
    assert ("driver+mps" in names) == ({"driver", "mps"} <= names)
    assert plan.total_seconds <= p.BUDGET_S  # with make gpu-proof, inside one 600 s call
