"""The megatron model in parts (orthon.backends.megatron.gathered_weights) on two gloo ranks holding its
tensor-, expert- or pipeline-parallel pieces: the parts, each gathered to its owner, are together orthon's
model exactly (the megatron model starts from the weights orthon's draws from the same seed), each is at
most the size asked for (a larger megatron tensor alone; an expert stack larger than that as windows of whole experts), and a part goes
to the rank ``owner`` names, nothing to the others. ``final/`` written in shards of that size is the same
model. With pipeline stages, each stage's parts gathered within the stage are that stage's tensors, and
the stages' together the whole model."""
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from orthon.core.net import free_port
from pretrain_support import MODEL, write_recipe
from spawn_support import spawn

pytest.importorskip("megatron.core")

PART_BYTES = 40_000  # the tiny model's ~0.4 MB in about a dozen parts; its 64 kB expert stacks in windows


def worker(rank, port, out_dir, recipe_path, layout):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    try:
        from orthon.backends.megatron.causal_lm import MegatronCausalLM
        from orthon.pretrain.recipe import load_recipe

        model = MegatronCausalLM(load_recipe(recipe_path, [f"megatron.{layout}=2"]))
        parts = [load() for load in model.weight_parts(PART_BYTES)]
        owned = [load() is not None for load in model.weight_parts(PART_BYTES, owner=lambda i: i % 2)]
        stage = model.stage_parts(PART_BYTES)
        staged = stage and (stage.stage, stage.stages, stage.leader, [load() for load in stage.loaders])
        model.save_weights(os.path.join(out_dir, "final"), write=rank == 0)
        torch.save({"parts": parts, "owned": owned, "staged": staged}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("layout", ["tensor_parallel", "expert_parallel", "pipeline_parallel"])
def test_the_parts_are_orthons_model_a_part_at_a_time(tmp_path, layout):
    from orthon.pretrain import GLMForCausalLM, ModelConfig
    from orthon.pretrain.config import RuntimeOptions
    from orthon.pretrain.hf_io import experts_to_hf, row_piece
    from orthon.pretrain.weights import load_weights

    recipe = write_recipe(tmp_path / "recipe.yaml", {"train": tmp_path / "none", "valid": tmp_path / "none"}, tmp_path / "run")
    spawn(worker, (free_port(), str(tmp_path), str(recipe), layout), nprocs=2)
    torch.manual_seed(0)  # the recipe's train.seed: megatron's model starts from orthon's first draw
    want = GLMForCausalLM(ModelConfig(**MODEL), runtime=RuntimeOptions(sparse_attention=False)).state_dict()
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    parts = got[0]["parts"]
    assert all(p is None for p in got[1]["parts"])  # owner 0: rank 1 sends, keeps nothing
    # each part at most PART_BYTES, but a megatron tensor larger than that, alone: the 77 kB embedding and
    # head, the dense MLP's 49 kB fused [gate; up]
    assert len(parts) > 5
    larger = [sorted(p) for p in parts if sum(t.numel() * t.element_size() for t in p.values()) > PART_BYTES]
    assert larger == [["model.embed_tokens.weight"], ["model.layers.0.mlp.gate_proj.weight",
                      "model.layers.0.mlp.up_proj.weight"], ["lm_head.weight"]]
    windows = [row_piece(name) for p in parts for name in p if row_piece(name)]
    assert windows and all(last - first < MODEL["n_routed_experts"] for _, first, last in windows)
    joined = experts_to_hf({k: v for p in parts for k, v in p.items()})
    reference = experts_to_hf(want)
    assert joined.keys() == reference.keys() and all(torch.equal(joined[k], reference[k]) for k in reference)
    # owner i mod 2: each rank gets the parts it owns, and only those
    assert got[0]["owned"] == [i % 2 == 0 for i in range(len(parts))]
    assert got[1]["owned"] == [i % 2 == 1 for i in range(len(parts))]
    # pipeline stages (here one rank each): each stage's leader gets exactly its stage's tensors
    if layout != "pipeline_parallel":
        assert got[0]["staged"] is None and got[1]["staged"] is None
    else:
        stages = [got[r]["staged"] for r in range(2)]
        assert [s[:3] for s in stages] == [(0, 2, True), (1, 2, True)]
        names = [experts_to_hf({k: v for p in s[3] for k, v in p.items()}) for s in stages]
        assert "model.embed_tokens.weight" in names[0] and "lm_head.weight" in names[1]
        assert {k.split(".")[2] for k in names[0] if k.startswith("model.layers.")} == {"0"}
        assert {k.split(".")[2] for k in names[1] if k.startswith("model.layers.")} == {"1"}
        assert not names[0].keys() & names[1].keys()
        assert all(torch.equal({**names[0], **names[1]}[k], reference[k]) for k in reference)
        assert len(names[0]) + len(names[1]) == len(reference)
    final = load_weights(tmp_path / "final").state_dict()
    assert all(torch.equal(final[k], want[k]) for k in want)


def test_a_map_belongs_to_the_pipeline_rank_holding_its_layer():
    """The embedding on the first pipeline rank, the final norm and head on the last, a layer on its stage's
    rank; with a virtual pipeline stage s (of layers_per_stage layers each) lies on rank s mod PP."""
    from types import SimpleNamespace

    from orthon.backends.megatron.convert import _Map
    from orthon.backends.megatron.gathered_weights import pipeline_rank_of

    def rank(name, pp, per_stage):
        model = SimpleNamespace(options=SimpleNamespace(pipeline_parallel=pp), layers_per_stage=per_stage)
        return pipeline_rank_of(_Map(("x",), (name,)), model)

    layer = "decoder.layers.{}.mlp.linear_fc1.weight"
    assert rank("embedding.word_embeddings.weight", 2, 2) == 0
    assert rank("decoder.final_layernorm.weight", 2, 2) == rank("output_layer.weight", 2, 2) == 1
    assert [rank(layer.format(i), 2, 2) for i in range(4)] == [0, 0, 1, 1]  # PP 2: two layers a stage
    assert [rank(layer.format(i), 2, 1) for i in range(4)] == [0, 1, 0, 1]  # PP 2 x VP 2: one layer a stage
    assert [rank(layer.format(i), 4, 1) for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
