"""make gpu-proof's MPS part: gpushare's own MpsControl on a real card.

Starts the node's MPS control daemon through :class:`gpushare.host.mps.MpsControl` (its
pipe and log directories under a scratch host directory), runs the enforcement probe's
kernel (``python -m gpushare.probe --spin``) as MPS clients with and without
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``, two capped clients at once, then the probe's
memory checks under ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, and stops the daemon.

    python3 scripts/gpu-proof-mps.py EXECUTABLE UUID [SCRATCH_DIR]

Prints one line per measurement (docs/gpu-proof.md keeps what a card printed). Exit
status 0 when each capped client ran at most 1.5 x its cap + 5 % of an uncapped one (the
probe's bar), 1 otherwise, 2 when the daemon or a client could not run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpushare.host.mps import MpsControl, MpsError

CAPS = (30, 60)
SPIN = ["--spin", "--spin-seconds", "3", "--spin-warmup", "1"]


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
    sys.exit(main(sys.argv[1:]))
