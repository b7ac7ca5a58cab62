#!/usr/bin/env bash
# Every CUDA check of the project in one run, for a lease of a GPU machine that must not be spent twice:
# the CUDA tests (tests/test_cuda.py), the megatron-core backend against the torch backend
# (bench/gpu_check.sh), Muon's Newton-Schulz on the GPU (bench/muon_step.py: standard, gram,
# torch.optim.Muon), the bf16 training step against transformers' on the GPU (bench/model_step.py),
# then the default test suite (which hides the GPU: its numbers are the CPU's) in the time left of
# --budget seconds: on 16 cores about 200 s, and torch's version there is the machine's own.
#
#   bash bench/cuda_checks.sh [--budget 420] [--only test_cuda,gpu_check,muon_step,model_step,suite] [-- SUITE PATHS]
#
# (a rerun of part of it: --only names the checks; the suite's pytest paths follow --, default tests/.)
# Each check writes OUT/<name>.log (OUT: $OUT, else a new temporary folder) and one line to
# OUT/summary.txt: its exit code and seconds. Without CUDA it says why and exits 0. ORTHON_WHEELS=DIR
# (default: .whl when it exists) installs the wheels in DIR first, for a machine without network
# (bench/cuda_wheels.sh downloads them; carry .whl with the run).
set -u
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
BUDGET=420
ONLY="env,test_cuda,gpu_check,muon_step,model_step,suite"
SUITE_PATHS=(tests)
while [ $# -gt 0 ]; do
    case "$1" in
        --budget) BUDGET="$2"; shift 2 ;;
        --only) ONLY="env,$2"; shift 2 ;;
        --) shift; SUITE_PATHS=("$@"); break ;;
        *) echo "cuda_checks: unknown argument $1" >&2; exit 2 ;;
    esac
done
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "cuda_checks: skipped: no CUDA device for $PY"
    exit 0
fi
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

WHEELS="${ORTHON_WHEELS:-.whl}"
if [ -d "$WHEELS" ]; then
    site="$(mktemp -d)"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$WHEELS"/*.whl \
        || echo "cuda_checks: some wheels of $WHEELS did not install" >&2
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    export ORTHON_WHEELS="$WHEELS"
fi
if ! "$PY" -c "import orthon.pretrain" >/dev/null 2>&1; then
    # orthon's packages are this checkout's folders: a link named orthon makes them importable.
    shim="$(mktemp -d)"
    ln -s "$ROOT" "$shim/orthon"
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi

check() {  # check NAME SECONDS COMMAND...: run it, keep its log, note its exit code and time
    local name="$1" limit="$2" start=$SECONDS rc
    shift 2
    case ",$ONLY," in *",$name,"*) ;; *) return 0 ;; esac
    echo "== $name (at most ${limit}s)"
    timeout -s INT -k 20 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $((SECONDS - start))s" | tee -a "$OUT/summary.txt"
    tail -n 8 "$OUT/$name.log"
}

check env 60 bash -c "nvidia-smi; $PY -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'; $PY -m pip list 2>/dev/null"
check test_cuda 150 "$PY" -m pytest -p no:cacheprovider -n 0 -q -rfEs tests/test_cuda.py
check gpu_check 150 bash bench/gpu_check.sh --steps 5
check muon_step 90 "$PY" bench/muon_step.py --device cuda --repeats 5
check model_step 120 "$PY" bench/model_step.py --device cuda --precision bf16 --shapes 16x1024,4x4096 --repeats 5
left=$((BUDGET - SECONDS))
if [ "$left" -gt 60 ]; then
    # The suite hides the GPU itself (tests/conftest.py): its numbers are the CPU's. -vv against the
    # project's -q: a line a test as it ends, so a suite stopped at its limit still says what ran.
    check suite "$left" "$PY" -m pytest -p no:cacheprovider -vv -rfE -n 14 --timeout 150 \
        --continue-on-collection-errors "${SUITE_PATHS[@]}"
    grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/suite.log" | tail -n 60
fi
echo "cuda_checks: logs in $OUT"
