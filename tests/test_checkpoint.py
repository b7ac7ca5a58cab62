"""Checkpoint writing is atomic and verified: a crash mid-save leaves nothing that looks finished, and
damage to a finished checkpoint is detected."""
import json

import pytest
import torch

from orthon.core.errors import CheckpointError
from orthon.pretrain.checkpoint import Checkpointer, verify


def _model_opt(inputs: int = 4, outputs: int = 3):
    """A linear layer and its AdamW after one step (so the optimizer has state)."""
    model = torch.nn.Linear(inputs, outputs)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, inputs)).sum().backward()
    opt.step()
    return model, opt


def test_crash_during_save_leaves_no_finished_checkpoint(tmp_path, monkeypatch):
    ckpt = Checkpointer(tmp_path, keep_last=3, log=lambda *_: None)
    model, opt = _model_opt()
    ckpt.save(1, model, [opt], {"step": 1})

    import orthon.pretrain.checkpoint as module

    class Killed(BaseException):
        pass

    def crash(*args, **kwargs):
        raise Killed("killed mid-write")

    monkeypatch.setattr(module, "sha256_file", crash)  # dies after the tensors, before the manifest
    with pytest.raises(Killed):
        ckpt.save(2, model, [opt], {"step": 2})
    monkeypatch.undo()
    assert [p.name for p in ckpt.step_dirs()] == ["step_00000001"]
    assert (tmp_path / "checkpoints" / "step_00000002.tmp").is_dir()  # the leftover is not a checkpoint
    assert ckpt.latest_good().name == "step_00000001"
    ckpt.save(2, model, [opt], {"step": 2})  # the next save replaces the leftover temporary directory
    assert [p.name for p in ckpt.step_dirs()] == ["step_00000001", "step_00000002"]
    assert not list(tmp_path.glob("checkpoints/*.tmp"))


def test_damage_is_detected_and_loading_round_trips(tmp_path):
    ckpt = Checkpointer(tmp_path, keep_last=2, log=lambda *_: None)
    model, opt = _model_opt()
    for step in (1, 2, 3):
        ckpt.save(step, model, [opt], {"step": step})
    assert [p.name for p in ckpt.step_dirs()] == ["step_00000002", "step_00000003"]  # keep_last
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    state = ckpt.load(ckpt.latest_good(), fresh, [fresh_opt])
    assert state == {"step": 3} and torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_opt.state[fresh.weight]["exp_avg"], opt.state[model.weight]["exp_avg"])

    newest = ckpt.step_dirs()[-1]
    manifest = json.loads((newest / "manifest.json").read_text())
    name = next(n for n in manifest["files"] if n.endswith(".distcp"))
    data = bytearray((newest / name).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte
    (newest / name).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its checksum"):
        verify(newest)
    assert ckpt.latest_good().name == "step_00000002"
    (ckpt.step_dirs()[0] / "manifest.json").unlink()
    assert ckpt.latest_good() is None


@pytest.mark.parametrize("keep_last", [1, 2])
def test_truncated_newest_is_moved_aside_and_never_costs_the_good_one(tmp_path, keep_last):
    model, opt = _model_opt()
    ckpt = Checkpointer(tmp_path, keep_last=2, log=lambda *_: None)
    for step in (4, 8):
        ckpt.save(step, model, [opt], {"step": step})
    newest = tmp_path / "checkpoints" / "step_00000008"
    victim = max((p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])

    messages = []
    resumed = Checkpointer(tmp_path, keep_last=keep_last, log=messages.append)  # a resumed run's
    assert resumed.latest_good().name == "step_00000004"
    assert any("step_00000008 is unusable" in m and "truncated" in m for m in messages)
    resumed.save(6, model, [opt], {"step": 6})  # the resumed run's next checkpoint
    kept = [p.name for p in resumed.step_dirs()]
    assert kept == (["step_00000006"] if keep_last == 1 else ["step_00000004", "step_00000006"])
    assert (tmp_path / "checkpoints" / "corrupt" / "step_00000008").is_dir()  # kept aside, not counted
    assert resumed.latest_good().name == "step_00000006"
    resumed.save(8, model, [opt], {"step": 8})  # the same step name again: no clash with the corrupt copy
    assert [p.name for p in resumed.step_dirs()][-1] == "step_00000008"
    verify(resumed.step_dirs()[-1])


def test_single_process_save_and_load_do_not_warn(tmp_path):
    """DCP's "torch.distributed is disabled" warning, which a single-process run means, is not printed:
    for a foreground save, a background one (the warning comes from the writing thread) and a load. Run
    in a fresh interpreter with Python's default warning filters, as a user's command runs."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import torch
        from orthon.pretrain.checkpoint import Checkpointer
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters())
        ckpt = Checkpointer({str(tmp_path)!r}, keep_last=2, log=print)
        ckpt.save(1, model, [opt], {{"step": 1}})
        ckpt.save(2, model, [opt], {{"step": 2}}, background=True)
        ckpt.wait()
        print(ckpt.load(ckpt.latest_good(), model, [opt]))
    """)
    done = subprocess.run([sys.executable, "-W", "default", "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "{'step': 2}"
    assert "torch.distributed is disabled" not in done.stderr, done.stderr


def test_a_checkpoint_from_before_an_optimizer_setting_existed_still_loads(tmp_path):
    """A param-group key added to an optimizer after a checkpoint was written (Muon's ns_method, say)
    keeps this run's value; the tensors load as saved. A missing tensor is still an error."""
    from orthon.optim import Muon

    model = torch.nn.Linear(6, 4, bias=False)
    opt = Muon(model.parameters(), lr=0.02, ns_method="gram")
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    for group in opt.param_groups:  # as written by a version of orthon without these settings
        del group["ns_method"], group["gram_dtype"]
    logs = []
    ckpt = Checkpointer(tmp_path, log=logs.append)
    ckpt.save(1, model, [opt], {"step": 1})

    fresh = torch.nn.Linear(6, 4, bias=False)
    fresh_opt = Muon(fresh.parameters(), lr=0.5, ns_method="gram")
    assert ckpt.load(ckpt.latest_good(), fresh, [fresh_opt]) == {"step": 1}
    assert torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh_opt.state[fresh.weight]["momentum_buffer"], opt.state[model.weight]["momentum_buffer"])
    group = fresh_opt.param_groups[0]
    assert group["lr"] == 0.02 and group["ns_method"] == "gram" and group["gram_dtype"] == "auto"
    assert any("predates the optimizer settings ['gram_dtype', 'ns_method']" in line for line in logs)

    bigger = torch.nn.Linear(6, 4)  # a bias the checkpoint never had
    with pytest.raises(CheckpointError, match=r"lacks \d+ entries.*model\.bias"):
        ckpt.load(ckpt.latest_good(), bigger, [Muon([bigger.weight], lr=0.1), torch.optim.AdamW([bigger.bias])])


def test_resuming_ranks_split_the_checksums(tmp_path, monkeypatch):
    """verify's share (i, n): each file is read by exactly one of the n ranks (sizes are checked by all),
    and corruption in a file is found by the rank whose share holds it."""
    import orthon.pretrain.checkpoint as module

    ckpt = Checkpointer(tmp_path, keep_last=1, log=lambda *_: None)
    model, opt = _model_opt()
    path = ckpt.save(1, model, [opt], {"step": 1})
    files = sorted(json.loads((path / "manifest.json").read_text())["files"])
    assert len(files) >= 3
    read = []
    real = module.sha256_file
    monkeypatch.setattr(module, "sha256_file", lambda p: read.append(p.name) or real(p))
    for i in range(3):
        verify(path, (i, 3))
    assert sorted(read) == files  # each once
    victim = files[1]
    data = bytearray((path / victim).read_bytes())
    data[0] ^= 0xFF
    (path / victim).write_bytes(bytes(data))  # same size: only a checksum finds it
    verify(path, (0, 3)), verify(path, (2, 3))
    with pytest.raises(CheckpointError, match=f"file {victim} fails its checksum"):
        verify(path, (1, 3))


def test_carry_into_a_related_model(tmp_path):
    """Mid-training's hand-over: the weights and the optimizer state of every parameter the source
    trained are carried by name; a parameter the source never trained keeps its (fresh) state; the
    source's weights the new model lacks are reported dropped; a weight the source lacks is refused."""
    from hf_reference import small_model
    from orthon.midtrain.optimizer import fill_state
    from orthon.pretrain.checkpoint import carry

    torch.manual_seed(0)
    source = small_model("dsa")  # 3 layers, each its own indexer
    trained = [p for n, p in source.named_parameters() if ".indexer." not in n]  # pretraining's indexers are frozen
    opt = torch.optim.AdamW(trained, lr=0.1)
    source(torch.randint(0, 257, (2, 9)), labels=torch.randint(0, 257, (2, 9))).loss.backward()
    opt.step()
    path = Checkpointer(tmp_path, log=lambda *_: None).save(1, source, [opt], {"step": 1})

    model = small_model("dsa", indexer_types=["full", "shared", "full"])  # IndexShare: layer 1 has none
    target = torch.optim.AdamW(model.parameters(), lr=0.1)
    fill_state(target)
    report = carry(path, model, [target])
    names = dict(model.named_parameters())
    src = dict(source.named_parameters())
    assert report["dropped"] == sorted(n for n in src if n.startswith("model.layers.1.self_attn.indexer."))
    assert sorted(report["fresh"]) == sorted(n for n in names if ".indexer." in n)
    assert report["carried"] == len(trained)
    for name, p in names.items():
        assert torch.equal(p, src[name]), name
        state = target.state[p]
        if ".indexer." in name:
            assert float(state["step"]) == 0 and not state["exp_avg"].any()
        else:
            want = opt.state[src[name]]
            assert float(state["step"]) == 1 and torch.equal(state["exp_avg_sq"], want["exp_avg_sq"]), name

    deeper = small_model("dsa", num_hidden_layers=4)
    with pytest.raises(CheckpointError, match=r"has no 'model.layers.3.[\w.]+' \(and \d+ more weights"):
        carry(path, deeper, [torch.optim.AdamW(deeper.parameters())])
