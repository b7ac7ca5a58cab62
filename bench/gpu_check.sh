#!/usr/bin/env bash
# The megatron-core backend's GPU check: builds the megatron-core model, compares its logits and one
# Muon + Split step with orthon's torch backend on the same weights, and times a training step of both
# (bench/gpu_check.py). Without CUDA it says why and exits 0.
#
#   bash bench/gpu_check.sh [--steps 10] [--batch 4] [--seq 2048] [--skip-timing]
#
# PYTHON picks the interpreter (default: python3). megatron-core must import there (pip install
# orthon[megatron]); on a machine without network, ORTHON_WHEELS=DIR installs the wheels in DIR into a
# temporary directory first. An orthon that does not import is taken from this checkout.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"

why=$("$PYTHON" - <<'PY' 2>&1 || true
try:
    import torch
except Exception as exc:
    print(f"torch does not import ({type(exc).__name__}: {exc})")
else:
    if not torch.cuda.is_available():
        print(f"no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False)")
PY
)
if [ -n "$why" ]; then
    echo "gpu_check: skipped: $why"
    exit 0
fi

if ! "$PYTHON" -c "import orthon.pretrain" >/dev/null 2>&1; then
    # orthon's packages are this checkout's folders (orthon.core is core/, ...): a link named orthon
    # to the checkout makes them importable without installing.
    shim="$(mktemp -d)"
    ln -s "$ROOT" "$shim/orthon"
    export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -n "${ORTHON_WHEELS:-}" ] && ! "$PYTHON" -c "import megatron.core" >/dev/null 2>&1; then
    site="$(mktemp -d)"
    "$PYTHON" -m pip install -q --no-index --no-deps --target "$site" "$ORTHON_WHEELS"/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! "$PYTHON" -c "import megatron.core" >/dev/null 2>&1; then
    echo "gpu_check: megatron-core does not import with $PYTHON; pip install orthon[megatron] (or ORTHON_WHEELS=DIR)" >&2
    exit 1
fi
exec "$PYTHON" "$ROOT/bench/gpu_check.py" "$@"
