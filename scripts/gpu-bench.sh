#!/usr/bin/env bash
# make gpu-bench: issue 42's figures on a GPU machine (root), in one call of at most 10
# minutes, nothing downloaded:
#   1. make gpu-proof as it is (scripts/gpu-proof.sh: the probe under every memory
#      backend; MPS, with v3 namespaces where the driver has them; the driver's memory
#      limits on r615+, saying whether dmem or misc), cut at PROOF_SECONDS;
#   2. python -m gpushare.bench.gpu: throughput kept by two tenants at 50 % / 50 % against
#      one alone, isolation under pressure, what a start costs (alone and 20 at once),
#      under every backend present, its steps stopped so that the whole ends within
#      TOTAL_SECONDS.
# Everything it needs that the machine lacks comes prepared (scripts/gpu-bench-prepare.sh
# on the CPU machine) in PREPARED (default .gpu-bench): libvgpu.so, gpushare-memory-hook,
# wheels/ (structlog; nvidia-ml-py where the machine has none). It never changes a GPU
# setting (MIG, persistence, clocks, compute mode); MPS daemons it starts it stops.
#
#   scripts/gpu-bench.sh [--dry-run] [--out DIR] [--prepared DIR] [-- bench options]
#
# Results under --out (default $OUT, else ./gpu-bench-out): gpu-bench.log (everything
# printed), gpu-bench.md (the report), gpu-bench.json (facts, plan, every measurement).
# GPU_PYTHON (else PYTHON, else python3) runs both parts. Exit status: the bench's (0 all
# ran, 1 some step failed or was skipped, 2 nothing could run), or 1 where only the
# proof failed.
set -u
DRY=""
PREPARED=${PREPARED:-.gpu-bench}
OUTDIR=${OUT:-./gpu-bench-out}
TOTAL_SECONDS=${TOTAL_SECONDS:-540}
PROOF_SECONDS=${PROOF_SECONDS:-150}
PY=${GPU_PYTHON:-${PYTHON:-python3}}
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=--dry-run ;;
    --out) OUTDIR=$2; shift ;;
    --prepared) PREPARED=$2; shift ;;
    --) shift; break ;;
    *) echo "usage: $0 [--dry-run] [--out DIR] [--prepared DIR] [-- bench options]" >&2; exit 2 ;;
  esac
  shift
done
START=$(date +%s)
mkdir -p "$OUTDIR"
# absolute: the interposer is named in LD_PRELOAD, which a tenant reads from its own cwd
case "$PREPARED" in /*) ;; *) PREPARED="$PWD/$PREPARED" ;; esac
exec > >(tee -a "$OUTDIR/gpu-bench.log") 2>&1
TEE=$!
say() { echo "gpu-bench: $*"; }
# the log is whole before the call returns: close tee's input and wait for it
end() { exec >/dev/null 2>&1; wait "$TEE" 2>/dev/null; exit "$1"; }
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ! "$PY" -c 'import structlog, pynvml' 2>/dev/null; then
  if ls "$PREPARED"/wheels/*.whl >/dev/null 2>&1; then
    SITE=$(mktemp -d /tmp/gpushare-bench-site.XXXXXX)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
      "$PREPARED"/wheels/*.whl && export PYTHONPATH="$PYTHONPATH:$SITE"
  fi
  "$PY" -c 'import structlog, pynvml' 2>/dev/null \
    || say "structlog or pynvml missing (no wheels in $PREPARED/wheels): MPS and NVML parts will fail"
fi
say "date $(date -u +%Y-%m-%dT%H:%M:%SZ); prepared: $(ls "$PREPARED" 2>/dev/null | tr '\n' ' ')"
say "--- part 1: make gpu-proof (scripts/gpu-proof.sh), at most ${PROOF_SECONDS} s"
PROOF_OUT=$(mktemp -d /tmp/gpushare-proof.XXXXXX)  # its per-backend files; the log has them
timeout --kill-after=15 "$PROOF_SECONDS" env PYTHON="$PY" scripts/gpu-proof.sh $DRY \
  --library "$PREPARED/libvgpu.so" --hook "$PREPARED/gpushare-memory-hook" --out "$PROOF_OUT"
PROOF=$?
[ "$PROOF" -eq 124 ] && say "gpu-proof: cut at ${PROOF_SECONDS} s"
LEFT=$(( TOTAL_SECONDS - ($(date +%s) - START) - 90 ))  # the last step (a hung one: 45-90 s) and the report
say "--- part 2: python -m gpushare.bench.gpu, steps until ${LEFT} s from now"
"$PY" -m gpushare.bench.gpu $DRY --out "$OUTDIR" --interposer "$PREPARED/libvgpu.so" \
  --hook "$PREPARED/gpushare-memory-hook" --deadline "$LEFT" "$@"
BENCH=$?
say "done in $(( $(date +%s) - START )) s: gpu-proof exit $PROOF, gpu-bench exit $BENCH"
[ "$BENCH" -ne 0 ] && end "$BENCH"
[ "$PROOF" -ne 0 ] && end 1
end 0
