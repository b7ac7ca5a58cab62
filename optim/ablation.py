"""The optimizer ablation: the same model, data, seed and token budget under several optimizer settings
(AdamW only; Muon; Muon + Split), compared by loss curve, steps to reach AdamW's final loss, wall time
and the largest attention logit per step."""
from __future__ import annotations

from dataclasses import dataclass, field

from orthon.core.metrics import moving_average


@dataclass
class AblationVariant:
    name: str
    overrides: list[str] = field(default_factory=list)


def _default_variants() -> list[AblationVariant]:
    return [
        AblationVariant("adamw", ["optim.algorithm=adamw"]),
        AblationVariant("muon", ["optim.algorithm=muon", "optim.muon_split=false"]),
        AblationVariant("muon_split", ["optim.algorithm=muon", "optim.muon_split=true"]),
    ]


@dataclass
class AblationConfig:
    out_dir: str = "runs/ablation"
    variants: list[AblationVariant] = field(default_factory=_default_variants)
    baseline: str = "adamw"  # the variant whose final loss the others race to
    smooth: int = 10  # steps in the moving average of the training loss


def steps_to_reach(steps: list[int], losses: list[float], target: float, window: int) -> int | None:
    """The step from which the smoothed loss stays at or below ``target`` to the end; None if it ends above.
    Not the first dip: the training loss of mixed batches is noisy, and a dip below the target that the
    curve climbs back from is not reaching it (the baseline's own curve would "reach" its final loss
    tens of steps early)."""
    reached = None
    for step, value in zip(steps, moving_average(losses, window)):
        if value > target:
            reached = None
        elif reached is None:
            reached = step
    return reached


def summarize(curves: dict[str, tuple[list[int], list[float]]], wall: dict[str, float], baseline: str,
              window: int) -> list[dict]:
    """One row per variant: final smoothed loss, the step from which it stays at or below the baseline's
    final smoothed loss (``steps_to_reach``), the ratio of that step to the baseline's own step count,
    wall time."""
    base_steps, base_losses = curves[baseline]
    target = moving_average(base_losses, window)[-1]
    rows = []
    for name, (steps, losses) in curves.items():
        reach = steps_to_reach(steps, losses, target, window)
        rows.append({
            "variant": name,
            "final_loss": round(moving_average(losses, window)[-1], 4),
            "steps_to_baseline_final": reach,
            "steps_ratio_vs_baseline": None if reach is None else round(reach / base_steps[-1], 3),
            "wall_s": round(wall[name], 1),
        })
    return rows


def format_table(rows: list[dict], baseline: str) -> str:
    head = (f"| variant | final loss | steps until at or below {baseline}'s final loss for good | ratio of {baseline}'s "
            f"steps | wall time (s) |")
    lines = [head, "|---|---|---|---|---|"]
    for r in rows:
        reach = "never" if r["steps_to_baseline_final"] is None else r["steps_to_baseline_final"]
        ratio = "-" if r["steps_ratio_vs_baseline"] is None else r["steps_ratio_vs_baseline"]
        lines.append(f"| {r['variant']} | {r['final_loss']} | {reach} | {ratio} | {r['wall_s']} |")
    return "\n".join(lines)
