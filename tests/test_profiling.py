"""`train.profile_from_step`: torch.profiler over a window of steps, a trace and an ops table per rank."""
import json

from pretrain_support import make_stores, orthon, write_recipe


def test_a_window_of_steps_is_traced(tmp_path):
    stores = make_stores(tmp_path / "data")
    run = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", stores, run,
                          train={"max_steps": 5, "profile_from_step": 3, "profile_steps": 2, "eval_interval": 0})
    out = orthon("pretrain", "-c", recipe, "--sample", "")
    folder = run / "profile" / "steps_3-4"
    assert f"profiled steps 3-4: {folder / 'rank0.trace.json'}" in out.stdout + out.stderr
    events = json.loads((folder / "rank0.trace.json").read_text())["traceEvents"]
    names = [e.get("name", "") for e in events]
    assert sum(n.startswith("ProfilerStep#") for n in names) == 2  # the two steps of the window, no more
    assert "aten::mm" in names  # the model's matmuls, with their shapes
    assert any(e.get("name") == "aten::mm" and e.get("args", {}).get("Input Dims") for e in events)
    table = (folder / "rank0_ops.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table
    assert [p.name for p in (run / "profile").iterdir()] == ["steps_3-4"]

    # Resumed past the window: nothing is traced again.
    orthon("pretrain", "--resume", run, "train.max_steps=7", "--sample", "")
    assert [p.name for p in (run / "profile").iterdir()] == ["steps_3-4"]
