"""Context parallelism: the zigzag split (hand-checked), the degree checks, and the model on two gloo ranks,
each running half of every sequence's positions, against one process running all of them: the summed
loss, every parameter's gradient (summed over the ranks, as data parallelism's reduction does), the
largest attention logit and mid-training's indexer KL, densely and through the DSA top-k, with packed
documents and without. The Trainer's runs (pretraining, mid-training) are in test_pretrain_parallel.py
and test_midtrain_parallel.py."""
import os

import pytest
import torch
import torch.distributed as dist

from orthon.core.errors import ConfigError
from orthon.core.net import free_port
from orthon.midtrain.indexer_fit import AttentionInputs, indexer_terms
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.context_parallel import check_degree, gathered_order, zigzag_runs
from orthon.pretrain.model import GLMForCausalLM
from pretrain_support import MODEL
from spawn_support import spawn

WORLD = 2


def test_zigzag_split_by_hand():
    # 8 positions, 2 ranks: chunks of 2; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert zigzag_runs(8, 2, 0) == [(0, 2), (6, 8)]
    assert zigzag_runs(8, 2, 1) == [(2, 4), (4, 6)]
    # Gathered in rank order the rows are positions 0 1 6 7 | 2 3 4 5: position p sits at row order[p].
    assert gathered_order(8, 2).tolist() == [0, 1, 4, 5, 6, 7, 2, 3]
    # Every position held once, and every rank's causal work (keys its queries see) the same.
    T, cp = 24, 4
    held = sorted(p for r in range(cp) for a, b in zigzag_runs(T, cp, r) for p in range(a, b))
    assert held == list(range(T))
    work = {sum(p + 1 for a, b in zigzag_runs(T, cp, r) for p in range(a, b)) for r in range(cp)}
    assert len(work) == 1
    assert gathered_order(T, 1).tolist() == list(range(T))


def test_degree_must_divide_the_ranks_and_split_the_sequence():
    check_degree(4, 8, 4096)
    check_degree(1, 3, 7)
    with pytest.raises(ConfigError, match=r"context_parallel = 3 does not divide the 8 ranks"):
        check_degree(3, 8, 4096)
    with pytest.raises(ConfigError, match=r"sequence length 100 must be a multiple of 2 x 4"):
        check_degree(4, 8, 100)
    with pytest.raises(ConfigError, match="at least 1"):
        check_degree(0, 8, 8)


@pytest.mark.parametrize("n,b", [(5, 12), (7, 7)], ids=["after-a-prefix", "from-the-start"])
def test_run_attention_equals_bottom_right_causal_attention(n, b):
    """The queries at the last n of b positions, over keys [0, b): the prefix and the run's own keys by two
    calls of the fused CPU kernel, merged by log-sum-exp, against one masked attention; values narrower
    than the keys (MLA's v_head_dim) as the model has them."""
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    from orthon.pretrain.attention import _run_attention

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, n, 3, 8, generator=g), torch.randn(2, b, 3, 8, generator=g)
    v, probe = torch.randn(2, b, 3, 6, generator=g), torch.randn(2, n, 3, 6, generator=g)
    mine = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _run_attention(*mine, 0.3)
    (out * probe).sum().backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref), attn_mask=causal_lower_right(n, b),
                                          scale=0.3).transpose(1, 2)
    (want * probe).sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    for got, expected in zip(mine, ref):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-6)


def _model(sparse: bool) -> GLMForCausalLM:
    torch.manual_seed(0)
    model = GLMForCausalLM(ModelConfig(**MODEL), runtime=RuntimeOptions(sparse_attention=sparse, query_chunk=24))
    model.track_max_logit(True)
    return model


def _batch(docs: bool):
    """Two sequences of 64 tokens (4 x index_topk: the top-k is a real selection), and their documents."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (2, 65), generator=g)
    doc_ids = torch.cumsum((torch.rand(2, 64, generator=g) < 0.08).long(), 1) if docs else None
    return ids[:, :-1], ids[:, 1:], doc_ids


def _loss_and_grads(sparse: bool, docs: bool, context=None) -> dict:
    """LM loss (summed) plus the indexer KL (over the selected keys when sparse, else every visible key),
    backward; the loss, the KL and the gradients, and the largest attention logit."""
    model = _model(sparse)
    x, y, doc_ids = _batch(docs)
    probe = AttentionInputs(model)
    with probe.recording():
        lm = model(x, labels=y, doc_ids=doc_ids, return_logits=False, loss_reduction="sum", context=context).loss
    kl = indexer_terms(model, probe.take(), "sparse" if sparse else "dense").kl_sum
    (lm + kl).backward()
    logit = model.max_attention_logit()
    return {"lm": lm.detach(), "kl": kl.detach(), "max_logit": torch.tensor(-1.0 if logit is None else logit),
            **{name: p.grad for name, p in model.named_parameters() if p.grad is not None}}


def _worker(rank, port, out_dir, sparse, docs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        from orthon.pretrain.context_parallel import ContextParallel

        got = _loss_and_grads(sparse, docs, ContextParallel(WORLD, torch.device("cpu")))
        for name, value in got.items():  # what the ranks' reduction makes of them
            dist.all_reduce(value, op=dist.ReduceOp.MAX if name == "max_logit" else dist.ReduceOp.SUM)
        if rank == 0:
            torch.save(got, os.path.join(out_dir, "got.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sparse,docs", [pytest.param(False, False, marks=pytest.mark.slow), (False, True), (True, True)],
                         ids=["dense", "dense-documents", "sparse-documents"])
def test_two_ranks_equal_one_process(sparse, docs, tmp_path):
    spawn(_worker, args=(free_port(), str(tmp_path), sparse, docs), nprocs=WORLD)
    got = torch.load(tmp_path / "got.pt")
    want = _loss_and_grads(sparse, docs)
    assert got.keys() == want.keys()
    # The indexers' parameters get gradients from the KL alone: they are among them.
    assert any(".indexer." in name for name in want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=name)
    if not sparse:  # the dense path tracks the largest logit (the gathered top-k path does not)
        assert want["max_logit"] > 0


def test_a_step_that_does_not_split_its_sequences_is_refused(tmp_path):
    """RL's and SFT's steps score whole responses: a recipe asking them for context parallelism is refused
    by name, on one process too (where pretraining's step would just run unsplit)."""
    from pathlib import Path

    from orthon.pretrain.recipe import load_recipe
    from orthon.pretrain.steps import TrainStep
    from orthon.pretrain.trainer import Trainer

    root = Path(__file__).resolve().parents[1]
    recipe = load_recipe(root / "configs/tiny.yaml", ["train.context_parallel=2", f"train.run_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"train.context_parallel = 2: TrainStep does not split its sequences"):
        Trainer(recipe, tmp_path, log=lambda *_: None, step=TrainStep(), with_data=False)
    Trainer(recipe, tmp_path, log=lambda *_: None, with_data=False)  # pretraining's step: unsplit on one rank
