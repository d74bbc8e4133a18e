"""``make gpu-bench`` (scripts/gpu-bench.sh) without a GPU: it parses, and its dry run
runs make gpu-proof's dry run and the bench's plan, runs nothing and exits 0, writing
only its log; a recorded card on PATH is read into both."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-bench.sh"
UUID = "GPU-2222cd7b-52eb-fd89-c0b1-ba91b23923dd"
#: A recorded card: nvidia-smi --query-gpu answers each field asked, in order.
FAKE_SMI = """#!{python}
import sys
card = {{"index": "0", "uuid": "{uuid}", "name": "NVIDIA H100 80GB HBM3",
        "driver_version": "615.41.02", "memory.total": "81559", "mig.mode.current": "Disabled",
        "persistence_mode": "Disabled", "compute_mode": "Default",
        "pci.bus_id": "00000000:1A:00.0"}}
with open("{log}", "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
query = next(a for a in sys.argv[1:] if a.startswith("--query-gpu="))
print(", ".join(card[f] for f in query.split("=", 1)[1].split(",")))
"""


def dry_run(tmp_path: Path, path: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), "--dry-run", "--out", str(tmp_path / "out"), "--prepared",
         str(tmp_path / "prepared")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={"PATH": path, "HOME": str(tmp_path), "GPU_PYTHON": sys.executable},
    )  # fmt: skip


def test_the_script_parses() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], timeout=30).returncode == 0


def test_the_dry_run_prints_both_parts_and_writes_only_its_log(tmp_path: Path) -> None:
    result = dry_run(tmp_path, "/usr/bin:/bin")  # no nvidia-smi
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout
    assert "gpu-bench: --- part 1: make gpu-proof" in text
    assert "gpu-proof: dry run: nothing run" in text
    assert "gpu-bench: --- part 2: python -m gpushare.bench.gpu" in text
    assert "backend time-sliced: absent: no GPU (no nvidia-smi on PATH)" in text
    assert "gpu-bench: dry run: nothing run" in text
    assert "gpu-proof exit 0, gpu-bench exit 0" in text
    assert os.listdir(tmp_path / "out") == ["gpu-bench.log"]
    assert "gpu-bench: dry run: nothing run" in (tmp_path / "out" / "gpu-bench.log").read_text()


def test_a_recorded_card_is_read_by_both_parts(tmp_path: Path) -> None:
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text(FAKE_SMI.format(python=sys.executable, uuid=UUID, log=tmp_path / "smi.log"))
    smi.chmod(0o755)
    result = dry_run(tmp_path, f"{smi.parent}:/usr/bin:/bin")
    assert result.returncode == 0, result.stdout + result.stderr
    text = result.stdout
    assert "gpu-proof: driver version: 615.41.02" in text
    assert "gpu-proof: driver RmMemacctMode: " in text
    assert (
        "card: NVIDIA H100 80GB HBM3 (GPU-2222cd7b-52eb-fd89-c0b1-ba91b23923dd), 81559 MiB" in text
    )
    assert "each tenant's share: 50 % = 40779 MiB" in text
    assert "backend interposer: absent: no libvgpu.so" in text  # nothing prepared
    # only questions were asked of nvidia-smi
    calls = (tmp_path / "smi.log").read_text().splitlines()
    assert calls and all(c.startswith("--query-gpu=") for c in calls)


def test_a_bad_option_is_a_usage_error() -> None:
    result = subprocess.run([str(SCRIPT), "--bogus"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "usage:" in result.stderr


#: nvidia-smi's options that change a card (MIG, persistence, clocks, power, compute
#: mode, ECC, reset): none may appear in what make gpu-bench runs.
SETTING = re.compile(
    r"(?<![\w-])(-mig|--multi-instance-gpu|-pm|--persistence-mode|-lgc|-rgc|-lmc|-rmc|"
    r"--lock-gpu-clocks|--reset-gpu-clocks|-ac|-rac|--applications-clocks|-pl|"
    r"--power-limit|-c|--compute-mode|-e|--ecc-config|-r|--gpu-reset|-am|-caa)(?![\w-])"
)


def test_nothing_it_runs_asks_nvidia_smi_to_change_a_card() -> None:
    sources = [
        ROOT / "scripts" / n
        for n in ("gpu-bench.sh", "gpu-proof.sh", "gpu-bench-prepare.sh", "gpu-proof-mps.py")
    ]
    sources += sorted((ROOT / "src" / "gpushare" / "bench" / "gpu").glob("*.py"))
    calls = [line for path in sources for line in path.read_text().splitlines()
             if "nvidia-smi" in line]  # fmt: skip
    assert any("--query-gpu" in line for line in calls)  # the scan sees the real calls
    assert [line for line in calls if SETTING.search(line.split("nvidia-smi", 1)[1])] == []
