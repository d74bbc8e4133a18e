"""make gpu-proof's MPS part: gpushare's own MpsControl on a real card.

Starts the node's MPS control daemon through :class:`gpushare.host.mps.MpsControl` (its
pipe and log directories under a scratch host directory), runs the enforcement probe's
kernel (``python -m gpushare.probe --spin``) as MPS clients with and without
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, two capped clients at once, then the probe's
memory checks under ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``; where the daemon speaks v3
(r615+: ``-p 3 -h`` lists namespaces) the same through gpushare's own namespaces
(``MpsControl.cap``: a namespace capped at 30 % and 1024 MiB before its client attaches,
the client given only the namespace's pipe directory, no caps in its env); then it stops
the daemon (also on SIGTERM: ``make gpu-bench`` cuts this part at a time limit).

    python3 scripts/gpu-proof-mps.py EXECUTABLE UUID [SCRATCH_DIR]

Prints one line per measurement (docs/gpu-proof.md keeps what a card printed). Exit
status 0 when each capped client ran at most 1.5 x its cap + 5 % of an uncapped one (the
probe's bar), 1 otherwise, 2 when the daemon or a client could not run.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpushare.host.mps import Cap, MpsControl, MpsError

CAPS = (30, 60)
#: Each client's counted run and warm-up, seconds (the tests shorten them on a stand-in).
SPIN = ["--spin", "--spin-seconds", os.environ.get("GPU_PROOF_SPIN_SECONDS", "3"),
        "--spin-warmup", os.environ.get("GPU_PROOF_SPIN_WARMUP", "1")]  # fmt: skip


def namespaces(control: MpsControl, uuid: str, scratch: Path, free: float) -> int:
    """A v3 namespace capped at 30 % and 1024 MiB pinned: its client's throughput against
    an uncapped client, and the probe's memory checks in it. 0 held, 1 not, 2 no run."""
    marker = scratch / "proof-namespace-marker"
    marker.mkdir(exist_ok=True)
    try:
        pipe = control.cap("proof30", Cap(marker, CAPS[0], 1024))
    except MpsError as exc:
        print(f"mps: v3 namespace: cannot cap: {exc}")
        return 2
    env = {**control.env(), "NVIDIA_VISIBLE_DEVICES": uuid, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
    try:
        spin = subprocess.run([sys.executable, "-m", "gpushare.probe", *SPIN], env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        try:
            got = float(spin.stdout.strip().splitlines()[-1]) / free
        except (IndexError, ValueError):
            print(f"mps: v3 namespace: the client printed no rate: {spin.stderr.strip()[-300:]}")
            return 2
        ok = got <= CAPS[0] / 100 * 1.5 + 0.05
        print(f"mps: {'ok  ' if ok else 'FAIL'} v3 namespace {pipe} capped at {CAPS[0]} % "
              f"(nothing in the client's env): {got:.0%} of uncapped", flush=True)  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "gpushare.probe", "--memory-backend", "driver",
             "--limit-mib", "1024", "--spin-seconds", "0.5", "--spin-warmup", "0"],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        print(f"mps: the probe in the namespace capped at 1024 MiB pinned "
              f"(exit {done.returncode}; informative):")  # fmt: skip
        for line in (done.stdout + done.stderr).splitlines():
            if not line.startswith("GPUSHARE-VERIFY"):
                print(f"mps:   {line}")
        return 0 if ok else 1
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"mps: v3 namespace: {exc}")
        return 2
    finally:
        control.forget("proof30")


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    executable, uuid = Path(argv[0]), argv[1]
    scratch = Path(argv[2]) if len(argv) == 3 else Path(tempfile.mkdtemp(prefix="gsmps-"))
    scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
    control = MpsControl(executable, scratch)
    began = time.monotonic()
    try:
        control.start()
    except MpsError as exc:
        print(f"mps: cannot start: {exc}")
        return 2
    print(f"mps: started pid {control.pid} in {time.monotonic() - began:.2f} s; "
          f"{control.capabilities}", flush=True)  # fmt: skip
    env = {**control.env(), "NVIDIA_VISIBLE_DEVICES": uuid}

    def client(percent: int | None) -> subprocess.Popen[str]:
        extra = {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(percent)} if percent else {}
        return subprocess.Popen(
            [sys.executable, "-m", "gpushare.probe", *SPIN],
            env={**env, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def rate(proc: subprocess.Popen[str]) -> float:
        out, _ = proc.communicate(timeout=120)
        try:
            return float(out.strip().splitlines()[-1])
        except (IndexError, ValueError):
            raise RuntimeError(f"a client printed no rate: {out.strip()[-300:]}") from None

    status = 0
    try:
        free = rate(client(None))
        print(f"mps: uncapped client {free:.0f} launches/s", flush=True)
        for percent in CAPS:
            got = rate(client(percent)) / free
            ok = got <= percent / 100 * 1.5 + 0.05
            status = status or (0 if ok else 1)
            print(f"mps: {'ok  ' if ok else 'FAIL'} CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percent}: "
                  f"{got:.0%} of uncapped", flush=True)  # fmt: skip
        pair = [client(CAPS[0]), client(CAPS[0])]
        rates = [rate(p) / free for p in pair]
        print(f"mps: two clients at {CAPS[0]} % at once: "
              f"{' and '.join(f'{r:.0%}' for r in rates)} of uncapped", flush=True)  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-m", "gpushare.probe", "--memory-backend", "driver",
             "--limit-mib", "1024", "--spin-seconds", "0.5", "--spin-warmup", "0"],
            env={**env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1024M"},
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        print(f"mps: the probe under CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=1024M "
              f"(exit {done.returncode}; informative):")  # fmt: skip
        for line in (done.stdout + done.stderr).splitlines():
            if not line.startswith("GPUSHARE-VERIFY"):
                print(f"mps:   {line}")
        if control.capabilities.namespaces:
            status = max(status, namespaces(control, uuid, scratch, free))
        else:
            print("mps: v3 namespaces: not offered by this daemon (-p 3 -h lists none)")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"mps: {exc}")
        status = 2
    finally:
        began = time.monotonic()
        control.stop()
        print(f"mps: stopped in {time.monotonic() - began:.2f} s; "
              f"alive after stop: {control.alive()}", flush=True)  # fmt: skip
    return status


if __name__ == "__main__":
    os.umask(0o022)
    # a SIGTERM (make gpu-bench's time limit) unwinds through main's finally: the daemon stops
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.exit(main(sys.argv[1:]))
