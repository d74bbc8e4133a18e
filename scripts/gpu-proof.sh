#!/usr/bin/env bash
# make gpu-proof: on a GPU machine (root), print what decides which enforcement backends
# the machine can prove (driver version, memory, MIG mode, cgroup type, dmem.capacity),
# then run the enforcement probe (python -m gpushare.probe) under every memory
# backend the machine supports:
#   interposer  HAMi-core's libvgpu.so preloaded, the limit in CUDA_DEVICE_MEMORY_LIMIT_0
#   driver      r615+ with cgroup v2: a scratch cgroup, the limit set by the memory hook
#               (hook/memory-hook.c, the program the daemon installs) from an OCI state
#               naming the probe's own process, the probe run in that cgroup
#               The hook's time is printed twice: as it ran (whatever held the driver
#               open then; the persistence mode is printed among the facts) and again
#               while a process holds NVML open, as the daemon does on a node (issue 41
#               item 6). Where the driver has no memory limits, NVML's open alone is
#               timed the same two ways (what the hook pays before its first call).
#   mps         where nvidia-cuda-mps-control is found and MIG is off: gpushare's own
#               MpsControl starts the daemon, capped clients run the probe's kernel
#               (scripts/gpu-proof-mps.py; v3 namespaces only where the driver has them)
# and says which of the driver's memory-limit backends it has (dmem: the kernel's cgroup
# controller lists the card; misc: the driver's own map; RmMemacctMode read from
# /proc/driver/nvidia/params). It changes no GPU setting; on dmem it enables the
# controller at the cgroup root for its scratch cgroup if needed, and disables it after.
# Options: --dry-run (print the facts that need no GPU and the plan, run nothing),
# --library PATH (libvgpu.so; default build/gpu-proof/libvgpu.so), --hook PATH (default
# build/gpu-proof/gpushare-memory-hook, built here with gcc if missing), --limit-mib N
# (default 1024), --out DIR (default $OUT or ./gpu-proof-out: each probe's report).
# Exit status: 0 every backend run held its limits, 1 one did not, 2 nothing could run.
set -u
DRY=0
LIMIT=1024
LIB=build/gpu-proof/libvgpu.so
HOOK=build/gpu-proof/gpushare-memory-hook
OUTDIR=${OUT:-./gpu-proof-out}
PY=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --library) LIB=$2; shift ;;
    --hook) HOOK=$2; shift ;;
    --limit-mib) LIMIT=$2; shift ;;
    --out) OUTDIR=$2; shift ;;
    *) echo "usage: $0 [--dry-run] [--library PATH] [--hook PATH] [--limit-mib N] [--out DIR]" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUTDIR"
say() { echo "gpu-proof: $*"; }

say "date $(date -u +%Y-%m-%dT%H:%M:%SZ), host $(uname -n), kernel $(uname -r)"
CGROUP_FS=$(stat -fc %T /sys/fs/cgroup 2>/dev/null || echo none)
say "cgroup file system at /sys/fs/cgroup: $CGROUP_FS"
if [ -r /sys/fs/cgroup/dmem.capacity ]; then
  say "dmem.capacity: $(tr '\n' ';' < /sys/fs/cgroup/dmem.capacity)"
else
  say "dmem.capacity: absent (the driver uses its misc backend, or has no memory limits)"
fi
# Which memory-limit backend the driver loaded with (RmMemacctMode: 0 off, 1 misc, 2 dmem,
# 3 auto; unset: auto), and where dmem is the kernel's, whether it lists the cards
MEMACCT=$(sed -n 's/.*RmMemacctMode=\([0-9xX]*\).*/\1/p' /proc/driver/nvidia/params 2>/dev/null | head -n 1)
say "driver RmMemacctMode: ${MEMACCT:-not set (auto)}"
if grep -q '^nvidia/' /sys/fs/cgroup/dmem.capacity 2>/dev/null; then LIMITS_BACKEND=dmem
else LIMITS_BACKEND=misc; fi
case "$MEMACCT" in 0|0x0) LIMITS_BACKEND=off ;; 1|0x1) LIMITS_BACKEND=misc ;; 2|0x2) LIMITS_BACKEND=dmem ;; esac
DRIVER=""
if command -v nvidia-smi >/dev/null 2>&1; then
  DRIVER=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1)
  say "driver version: ${DRIVER:-unknown}"
  nvidia-smi --query-gpu=index,uuid,name,memory.total,memory.reserved,mig.mode.current,persistence_mode \
    --format=csv 2>/dev/null | sed 's/^/gpu-proof:   /'
  say "persistence mode: $(nvidia-smi --query-gpu=persistence_mode --format=csv,noheader 2>/dev/null | tr '\n' ' ')"
else
  say "driver version: no nvidia-smi here"
  say "persistence mode: unknown (no nvidia-smi)"
fi
say "hook timing: the memory hook (or NVML's open) is timed cold and with NVML held open"
# MPS v3's command words: what docs/choosing.md lists as not verified without a GPU
MPS_CONTROL=$(command -v nvidia-cuda-mps-control 2>/dev/null || true)
if [ -n "$MPS_CONTROL" ]; then
  say "mps control: $MPS_CONTROL; its protocol 3 help (-p 3 -h) follows"
  { "$MPS_CONTROL" -p 3 -h 2>&1 || echo "(no protocol 3)"; } | head -n 120 | sed 's/^/gpu-proof:   /'
else
  say "mps control: no nvidia-cuda-mps-control here"
fi
MAJOR=${DRIVER%%.*}
UUID=$(nvidia-smi --query-gpu=uuid --format=csv,noheader 2>/dev/null | head -n 1)
MIG=$(nvidia-smi --query-gpu=mig.mode.current --format=csv,noheader 2>/dev/null | head -n 1)

PLAN="interposer"
WHY_NOT_DRIVER=""
if [ -z "$DRIVER" ]; then WHY_NOT_DRIVER="no driver"
elif ! [ "$MAJOR" -ge 615 ] 2>/dev/null; then WHY_NOT_DRIVER="driver $DRIVER is older than r615"
elif [ "$CGROUP_FS" != cgroup2fs ]; then WHY_NOT_DRIVER="no cgroup v2 at /sys/fs/cgroup"
elif [ "$MIG" = Enabled ]; then WHY_NOT_DRIVER="MIG mode is on"
elif [ "$LIMITS_BACKEND" = off ]; then WHY_NOT_DRIVER="the driver's memory accounting is off (RmMemacctMode=0)"
else PLAN="$PLAN driver"; fi
if [ -n "$MPS_CONTROL" ] && [ "$MIG" != Enabled ]; then PLAN="$PLAN mps"; fi
say "backends to prove: $PLAN${WHY_NOT_DRIVER:+ (not driver: $WHY_NOT_DRIVER)}"
case " $PLAN " in *" driver "*) say "driver memory limits expected on the $LIMITS_BACKEND backend" ;; esac
if [ "$DRY" = 1 ]; then
  say "dry run: nothing run"
  exit 0
fi
if [ -z "$UUID" ]; then say "no GPU: nothing to prove"; exit 2; fi

# Milliseconds since the epoch (GNU date).
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
# A process holding NVML open until its stdin closes, as the daemon does on a node; its
# pid in HOLDER, its stdin on fd 9.
hold_nvml() {
  coproc NVMLHOLD { "$PY" -c 'import sys, pynvml; pynvml.nvmlInit(); print("held", flush=True); sys.stdin.read()' 2>/dev/null; }
  HOLDER=$NVMLHOLD_PID
  read -r _ <&"${NVMLHOLD[0]}"
  exec 9>&"${NVMLHOLD[1]}"
}
release_nvml() { exec 9>&-; wait "$HOLDER" 2>/dev/null; }
# NVML's open as the hook does it before its first call (where the hook cannot run)
time_nvml_open() {
  local t0; t0=$(now_ms)
  "$PY" -c 'import pynvml; pynvml.nvmlInit(); pynvml.nvmlDeviceGetHandleByIndex(0); pynvml.nvmlShutdown()' \
    2>/dev/null && echo "$(( $(now_ms) - t0 )) ms" || echo "failed (no NVML here)"
}

status=0
run_probe() {  # name, then the command; the report goes to $OUTDIR/<name>.txt
  local name=$1; shift
  say "--- $name"
  "$@" > "$OUTDIR/$name.txt" 2>&1
  local code=$?
  cat "$OUTDIR/$name.txt"
  say "$name: probe exit $code"
  [ $code -eq 0 ] || status=1
}

if [ -r "$LIB" ]; then
  run_probe interposer env NVIDIA_VISIBLE_DEVICES="$UUID" LD_PRELOAD="$LIB" \
    CUDA_DEVICE_MEMORY_LIMIT_0="${LIMIT}m" CUDA_DEVICE_SM_LIMIT=30 \
    CUDA_DEVICE_MEMORY_SHARED_CACHE="$OUTDIR/vgpu.cache" \
    "$PY" -m gpushare.probe --library libcuda.so.1
else
  say "interposer: no $LIB (scripts/build-hami-core.sh builds it): not run"
fi

case " $PLAN " in *" driver "*)
  if [ ! -x "$HOOK" ]; then
    mkdir -p "$(dirname "$HOOK")"
    gcc -O2 -Wall -Wextra -o "$HOOK" hook/memory-hook.c -ldl || { say "cannot build the hook"; exit 2; }
  fi
  CG=/sys/fs/cgroup/gpushare-proof-$$
  # on dmem a limit can be set only where the parent enabled the controller; enabled here
  # only if it is not yet, and disabled again after
  DMEM_ENABLED=0
  if [ "$LIMITS_BACKEND" = dmem ] && ! grep -qw dmem /sys/fs/cgroup/cgroup.subtree_control; then
    if echo +dmem > /sys/fs/cgroup/cgroup.subtree_control; then DMEM_ENABLED=1
      say "enabled +dmem in /sys/fs/cgroup/cgroup.subtree_control (disabled again after)"
    else say "could not enable +dmem at the cgroup root"; fi
  fi
  mkdir "$CG" || { say "cannot make $CG"; exit 2; }
  FIFO=$OUTDIR/go.$$; mkfifo "$FIFO"
  # the probe's process enters the scratch cgroup, waits until the hook has set the limit
  ( echo "$BASHPID" > "$CG/cgroup.procs"; read -r _ < "$FIFO"
    exec env NVIDIA_VISIBLE_DEVICES="$UUID" "$PY" -m gpushare.probe \
      --memory-backend driver --limit-mib "$LIMIT" ) > "$OUTDIR/driver.txt" 2>&1 &
  PROBE=$!
  sleep 0.2
  say "--- driver (cgroup $CG, pid $PROBE)"
  STATE="{\"ociVersion\":\"1.2.0\",\"id\":\"proof\",\"status\":\"creating\",\"pid\":$PROBE,\"bundle\":\"/\"}"
  T0=$(now_ms)
  if echo "$STATE" | "$HOOK" --gpu "$UUID" --limit-mib "$LIMIT"; then
    COLD=$(( $(now_ms) - T0 ))
    hold_nvml
    T0=$(now_ms); echo "$STATE" | "$HOOK" --gpu "$UUID" --limit-mib "$LIMIT"; HELD=$(( $(now_ms) - T0 ))
    release_nvml
    say "hook time: ${COLD} ms as run (persistence mode above), ${HELD} ms with NVML held open (as the daemon holds it)"
    say "hook: limit set; nvidia-smi reads: $(nvidia-smi memory-limits --get -n "$CG" -i "$UUID" 2>&1 | tr '\n' ';')"
    if [ -r "$CG/dmem.max" ]; then
      say "driver memory limits: dmem backend ($CG/dmem.max: $(tr '\n' ';' < "$CG/dmem.max"))"
    else
      say "driver memory limits: misc backend ($CG has no dmem.max: the driver keeps the limit in its own map)"
    fi
    echo go > "$FIFO"; wait $PROBE; code=$?
  else
    say "hook: FAILED (above); the probe is not run"; kill $PROBE 2>/dev/null; code=1
  fi
  cat "$OUTDIR/driver.txt"; say "driver: probe exit $code"
  [ $code -eq 0 ] || status=1
  rm -f "$FIFO"; rmdir "$CG" 2>/dev/null
  if [ "$DMEM_ENABLED" = 1 ]; then
    echo -dmem > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || say "could not disable +dmem again"
  fi
  ;;
esac
case " $PLAN " in *" driver "*) ;; *)
  COLD=$(time_nvml_open)
  hold_nvml; HELD=$(time_nvml_open); release_nvml
  say "hook time: not run ($WHY_NOT_DRIVER); NVML's open (a Python process, its start included): ${COLD} as run, ${HELD} with NVML held open"
  ;;
esac
case " $PLAN " in *" mps "*)
  say "--- mps ($MPS_CONTROL)"
  "$PY" scripts/gpu-proof-mps.py "$MPS_CONTROL" "$UUID" "$(mktemp -d /tmp/gpushare-proof-mps.XXXXXX)" \
    2>&1 | tee "$OUTDIR/mps.txt"
  code=${PIPESTATUS[0]}
  say "mps: exit $code"
  [ "$code" -eq 0 ] || status=1
  ;;
esac
say "done: exit $status"
exit $status
