"""What the step metrics say about the device: its peak FLOP/s (the denominator of MFU) and the memory a
step took."""
from __future__ import annotations

import re
import resource
import sys

import torch

# Dense (no 2:4 sparsity) bf16 tensor-core peaks from the vendors' datasheets, FLOP/s, by a pattern of
# torch.cuda.get_device_name (e.g. "NVIDIA H100 80GB HBM3"); the first match wins, so the more specific
# names come first. MFU is quoted against the bf16 peak whatever the training precision, as the field does.
BF16_PEAK_FLOPS = (
    (r"\bGB200\b", 2.5e15),
    (r"\bB200\b", 2.25e15),
    (r"\bH100\b.*\bPCIe\b", 756e12),
    (r"\bH100\b.*\bNVL\b", 835e12),
    (r"\b(GH200|H100|H200|H800)\b", 989e12),
    (r"\bH20\b", 148e12),
    (r"\b(A100|A800)\b", 312e12),
    (r"\bL40S\b", 362e12),
    (r"\bMI300X\b", 1307e12),
)


def peak_flops(device: torch.device, override_tflops: float = 0.0) -> float | None:
    """The device's peak FLOP/s: ``override_tflops`` (train.peak_tflops) when set, else a known GPU's dense
    bf16 peak; None where neither says (a CPU, an unlisted GPU): the step metrics then leave MFU out."""
    if override_tflops > 0:
        return override_tflops * 1e12
    return bf16_peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None


def bf16_peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by its name (BF16_PEAK_FLOPS), None for one not listed."""
    return next((peak for pattern, peak in BF16_PEAK_FLOPS if re.search(pattern, device_name)), None)


def throughput_metrics(flops_per_s: float, peak: float | None) -> dict[str, float]:
    """The step metrics of a device's model FLOPs a second: tflops_per_device and, where the device's peak
    FLOP/s is known, mfu_pct."""
    metrics = {"tflops_per_device": flops_per_s / 1e12}
    if peak:
        metrics["mfu_pct"] = 100.0 * flops_per_s / peak
    return metrics


def step_memory(device: torch.device) -> dict[str, float]:
    """The memory a step took, for its metrics. CUDA: the caching allocator's peak reserved bytes since the
    previous call (the peak is reset here), also as a percentage of the device's memory, and its count of
    cudaMalloc retries (frees and retries under memory pressure: fragmentation, a step near the limit).
    CPU: the process's peak resident set so far."""
    gib = 2**30
    if device.type == "cuda":
        peak = torch.cuda.max_memory_reserved(device)
        retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
        torch.cuda.reset_peak_memory_stats(device)
        total = torch.cuda.get_device_properties(device).total_memory
        return {"memory_peak_gib": peak / gib, "memory_peak_pct": 100.0 * peak / total, "cuda_alloc_retries": retries}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return {"memory_peak_gib": peak * (1 if sys.platform == "darwin" else 1024) / gib}
