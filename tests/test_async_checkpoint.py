"""Background checkpoints (`train.async_checkpoint`): the state of the step is copied before training
goes on, the checkpoint becomes one (manifest, final name) only once it is written, and a run saving in
the background writes exactly the checkpoints of a run saving in the foreground."""
import json

import pytest
import torch

from pretrain_support import losses, make_stores, orthon, write_recipe
from test_checkpoint import _model_opt
from orthon.pretrain.checkpoint import Checkpointer, verify
from orthon.pretrain.model import GLMForCausalLM
from orthon.pretrain.recipe import load_recipe


def test_a_background_save_holds_the_state_it_was_given(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=2, log=lambda *_: None)
    model, opt = _model_opt(64, 32)
    weight, moment = model.weight.detach().clone(), opt.state[model.weight]["exp_avg"].clone()
    ckpt.save(1, model, [opt], {"step": 1}, background=True)
    assert ckpt.has(1) and not ckpt.step_dirs()  # in flight: a .tmp directory, nothing resume would take
    with torch.no_grad():  # the next step changes everything in place while the thread writes
        model.weight.add_(1.0)
        opt.state[model.weight]["exp_avg"].mul_(3.0)
    ckpt.wait()
    (done,) = ckpt.step_dirs()
    verify(done)
    fresh = torch.nn.Linear(64, 32)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    assert ckpt.load(done, fresh, [fresh_opt]) == {"step": 1}
    assert torch.equal(fresh.weight, weight) and torch.equal(fresh_opt.state[fresh.weight]["exp_avg"], moment)

    for step in (2, 3):  # each save completes the one in flight first; pruning as in the foreground
        ckpt.save(step, model, [opt], {"step": step}, background=True)
    assert [p.name for p in ckpt.step_dirs()] == ["step_00000001", "step_00000002"]
    ckpt.wait()
    assert [p.name for p in ckpt.step_dirs()] == ["step_00000002", "step_00000003"]
    assert not list(tmp_path.glob("checkpoints/*.tmp"))
    ckpt.wait()  # nothing in flight: nothing to do


def _state(path, recipe):
    model = GLMForCausalLM(recipe.model, runtime=recipe.runtime)
    trainer_state = Checkpointer(path.parent.parent).load_model(path, model)
    return model.state_dict(), trainer_state


def test_a_run_saving_in_the_background_writes_the_same_checkpoints(tmp_path):
    stores = make_stores(tmp_path / "data")
    train = {"max_steps": 9, "checkpoint_interval": 4, "eval_interval": 0}
    runs = {}
    for mode in ("foreground", "background"):
        runs[mode] = tmp_path / mode
        recipe = write_recipe(tmp_path / f"{mode}.yaml", stores, runs[mode], train=train)
        orthon("pretrain", "-c", recipe, f"train.async_checkpoint={mode == 'background'}", "--sample", "")
    assert losses(runs["background"]) == losses(runs["foreground"])
    recipe = load_recipe(tmp_path / "foreground.yaml", [])
    names = [p.name for p in Checkpointer(runs["foreground"]).step_dirs()]
    assert names == [p.name for p in Checkpointer(runs["background"]).step_dirs()] == \
        ["step_00000004", "step_00000008", "step_00000009"]
    for name in names:
        ours, theirs = (_state(runs[mode] / "checkpoints" / name, recipe) for mode in ("background", "foreground"))
        verify(runs["background"] / "checkpoints" / name)
        assert ours[1] == theirs[1]  # step, tokens, data position, RNG
        assert all(torch.equal(ours[0][k], theirs[0][k]) for k in theirs[0])
    final = json.loads((runs["background"] / "checkpoints" / names[-1] / "trainer_state.json").read_text())
    assert final["step"] == 9
