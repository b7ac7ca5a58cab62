"""The orthon distribution.

The repository's root folders are the subpackages of the ``orthon`` import
namespace (``pretrain/`` is ``orthon.pretrain`` and so on). ``orthon`` itself
is a namespace package, so nothing installs a top-level ``data``, ``optim``
or ``launch`` module.
"""
from pathlib import Path

from setuptools import setup

SUBPACKAGES = ["core", "data", "optim", "pretrain", "engine", "midtrain", "rl", "backends", "launch"]


def package_dirs() -> dict[str, str]:
    """orthon.<folder>[.<sub>...] -> folder path, for every folder holding an __init__.py."""
    here = Path(__file__).parent
    dirs = {}
    for top in SUBPACKAGES:
        if not (here / top).is_dir():
            continue
        for init in sorted((here / top).rglob("__init__.py")):
            rel = init.parent.relative_to(here)
            dirs["orthon." + ".".join(rel.parts)] = rel.as_posix()
    return dirs


setup(
    name="orthon",
    version="0.1.0",
    description="GLM-5-style LLM training: Muon pretraining, long-context mid-training, async RL",
    python_requires=">=3.10",
    packages=list(package_dirs()),
    package_dir=package_dirs(),
    package_data={"orthon.engine": ["decode_kernels.c"],  # built at run time
                  "orthon.optim": ["symmetric_kernels.c"],
                  "orthon.pretrain": ["sparse_kernels.c", "fused_kernels.c", "simd_math.h"]},
    install_requires=[
        # torch is pinned by the README's install line (CPU wheel); a range here
        # keeps pip from replacing it with a CUDA build. Run on 2.13 (CI) and 2.11
        # (an H200's CUDA image: bench/cuda_checks.sh); older ones lack APIs used here.
        "torch>=2.11",
        "numpy",
        "safetensors",
        "pyyaml",
        "tqdm",
        "tensorboard",
        "matplotlib",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "transformers>=5.20", "openai"],
        "data": ["datasets", "sentencepiece", "tokenizers", "datasketch", "pyarrow"],
        "rl": ["ray", "zstandard", "xxhash", "math-verify", "sglang-router", "fastapi", "uvicorn"],
        "mindspore": ["mindspore"],
        "megatron": ["megatron-core>=0.16"],
        "sglang": ["sglang"],
        "te": ["transformer-engine"],
    },
    entry_points={"console_scripts": ["orthon = orthon.launch.cli:main"]},
)
