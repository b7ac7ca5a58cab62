"""bench/time_to_loss.py's crossing time: hand-checked interpolation between evaluations."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("time_to_loss", ROOT / "bench/time_to_loss.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_time_to_reach_interpolates_between_evaluations():
    reach = _bench().time_to_reach
    curve = [(0.0, 8.0), (10.0, 6.0), (20.0, 5.0), (30.0, 4.0)]
    assert reach(curve, 6.0) == 10.0
    assert reach(curve, 5.5) == 15.0  # halfway from 6.0 @ 10 s to 5.0 @ 20 s
    assert abs(reach(curve, 4.25) - 27.5) < 1e-12
    assert reach(curve, 8.5) == 0.0  # already there at the first evaluation
    assert reach(curve, 3.9) is None


def test_time_to_reach_takes_the_first_crossing():
    # A noisy curve dips under the target, rises, dips again: the first crossing counts.
    curve = [(0.0, 8.0), (4.0, 4.0), (8.0, 6.0), (12.0, 3.0)]
    assert _bench().time_to_reach(curve, 5.0) == 3.0
