#!/usr/bin/env bash
# The wheels bench/cuda_checks.sh installs on a GPU machine without network (its image: Python 3.12 with
# torch, numpy, safetensors, sentencepiece, tokenizers, pyyaml, pytest, xdist, tensorboard; what orthon and
# its tests need beyond that). Downloads them into DIR (default .whl, which .git/info/exclude should list)
# at the versions this environment has, for CPython 3.12 on x86-64 Linux.
#
#   bash bench/cuda_wheels.sh [DIR]
set -euo pipefail
DIR="${1:-.whl}"
PY="${PYTHON:-python}"
NAMES=(transformers huggingface_hub kernels httpx2 httpcore2 hf-xet tomlkit truststore megatron-core zstandard
       fastapi starlette pydantic pydantic_core typing-inspection annotated-types opentelemetry-api uvicorn
       datasets dill multiprocess math-verify latex2sympy2_extended antlr4-python3-runtime datasketch)
mkdir -p "$DIR"
specs=()
for name in "${NAMES[@]}"; do
    version=$("$PY" -m pip show "$name" 2>/dev/null | awk '/^Version:/{print $2}')
    if [ -z "$version" ]; then
        echo "cuda_wheels: $name is not installed here; skipped" >&2
        continue
    fi
    specs+=("$name==$version")
done
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_28_x86_64 manylinux_2_34_x86_64; do
    platforms+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$DIR" "${specs[@]}"
du -sh "$DIR"
