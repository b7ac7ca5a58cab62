"""Parameter routing: Muon / AdamW by ParamSpec, splits, errors naming the parameter, full GLM-5 on meta."""
import pytest
import torch
from torch import nn

from orthon.optim import OptimConfig, RoutingError, format_plan, plan_for_model, route_parameters
from orthon.optim.param_spec import ParamSpec


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.q_b = nn.Linear(8, 12, bias=False)
        self.mlp = nn.Linear(8, 20)
        self.experts = nn.Parameter(torch.zeros(4, 6, 8))
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 50, bias=False)


SPECS = {
    "experts": ParamSpec("expert_stack"),
    "embed.weight": ParamSpec("embedding"),
    "q_b.weight": ParamSpec("matrix", split_rows=3),
    "mlp.weight": ParamSpec("matrix"),
    "mlp.bias": ParamSpec("bias"),
    "norm.weight": ParamSpec("norm"),
    "norm.bias": ParamSpec("bias"),
    "head.weight": ParamSpec("output_head"),
}


def routes(**kwargs):
    plan = route_parameters(Toy().named_parameters(), SPECS, **kwargs)
    return {r.name: r for r in plan.routes}, plan


def test_default_rule():
    by_name, plan = routes()
    assert {n for n, r in by_name.items() if r.optimizer == "muon"} == {"experts", "q_b.weight", "mlp.weight"}
    assert by_name["q_b.weight"].split_rows == 3
    assert (by_name["q_b.weight"].num_blocks, by_name["q_b.weight"].block_shape) == (3, (4, 8))
    assert (by_name["experts"].num_blocks, by_name["experts"].block_shape) == (4, (6, 8))
    assert by_name["head.weight"].optimizer == "adamw" and by_name["head.weight"].block_shape is None
    totals = plan.totals()
    assert totals["muon"] == {"params": 3, "numel": 4 * 48 + 96 + 160, "blocks": 4 + 3 + 1, "split_params": 1}
    assert totals["adamw"]["numel"] == 400 + 20 + 8 + 8 + 400
    assert totals["total"]["numel"] == sum(p.numel() for p in Toy().parameters())
    assert [r.name for r in plan.routes] == [n for n, _ in Toy().named_parameters()]


def test_rule_options():
    by_name, _ = routes(head_to_muon=True)
    assert by_name["head.weight"].optimizer == "muon"
    by_name, _ = routes(muon_split=False)
    assert by_name["q_b.weight"].split_rows == 1
    by_name, _ = routes(extra_splits={"mlp.*": 5, "experts": 2})
    assert by_name["mlp.weight"].split_rows == 5 and by_name["experts"].block_shape == (3, 8)
    by_name, _ = routes(adamw_only=True)
    assert {r.optimizer for r in by_name.values()} == {"adamw"}


def test_format_plan_lists_every_parameter_and_totals():
    _, plan = routes()
    text = format_plan(plan)
    for name in SPECS:
        assert name in text
    assert "3 x 4x8 (split 3)" in text and "4 x 6x8" in text
    assert "muon:     3 parameters" in text and "total:     8 parameters" in text


@pytest.mark.parametrize(
    "named, specs, kwargs, message",
    [
        (None, {k: v for k, v in SPECS.items() if k != "norm.bias"}, {}, "'norm.bias' is not routed"),
        (None, {**SPECS, "ghost.weight": ParamSpec("matrix")}, {}, "'ghost.weight' names no parameter"),
        (None, {**SPECS, "q_b.weight": ParamSpec("matrix", split_rows=5)}, {}, "'q_b.weight': 5 row blocks do not divide its 12 rows"),
        (None, {**SPECS, "experts": ParamSpec("matrix")}, {}, "'experts': kind 'matrix' needs 2 dims"),
        (None, {**SPECS, "norm.weight": ParamSpec("norm", split_rows=2)}, {}, "'norm.weight': split_rows=2"),
        (None, SPECS, {"extra_splits": {"nothing.*": 2}}, "'nothing.*' matches no Muon parameter"),
        (None, SPECS, {"extra_splits": {"norm.weight": 2}}, "'norm.weight' matches no Muon parameter"),
        (None, SPECS, {"extra_splits": {"mlp.weight": 3}}, "'mlp.weight': 3 row blocks do not divide its 20 rows"),
        ("twice-name", SPECS, {}, "'mlp.weight' is routed twice"),
        ("twice-tensor", {**SPECS, "alias": ParamSpec("matrix")}, {}, "'alias' is routed twice: it is the same tensor as 'mlp.weight'"),
    ],
)
def test_errors_name_the_parameter(named, specs, kwargs, message):
    model = Toy()
    params = list(model.named_parameters())
    if named == "twice-name":
        params.append(("mlp.weight", nn.Parameter(torch.zeros(20, 8))))
    elif named == "twice-tensor":
        params.append(("alias", model.mlp.weight))
    with pytest.raises(RoutingError, match=message.replace("(", r"\(").replace("*", r"\*")):
        route_parameters(params, specs, **kwargs)


def test_full_glm5_on_meta_routes_every_parameter_once():
    from orthon.pretrain.config import ModelConfig
    from orthon.pretrain.model_info import meta_model, parameter_counts

    config = ModelConfig()
    model = meta_model(config)
    plan = plan_for_model(model, OptimConfig())
    names = [n for n, _ in model.named_parameters()]
    assert [r.name for r in plan.routes] == names and len(set(names)) == len(names)
    totals = plan.totals()
    assert totals["total"]["numel"] == sum(c["total"] for c in parameter_counts(config).values())
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    split = [r for r in plan.routes if r.split_rows > 1]
    assert len(split) == 2 * layers and all(r.split_rows == heads for r in split)
    q_b = {r.block_shape for r in split if "q_b_proj" in r.name}
    kv_b = {r.block_shape for r in split if "kv_b_proj" in r.name}
    assert q_b == {(config.qk_head_dim, config.q_lora_rank)}
    assert kv_b == {(config.qk_nope_head_dim + config.v_head_dim, config.kv_lora_rank)}
    adamw = {r.kind for r in plan.routes if r.optimizer == "adamw"}
    assert adamw == {"embedding", "output_head", "norm", "bias"}
    assert {r.kind for r in plan.routes if r.optimizer == "muon"} == {"matrix", "expert_stack"}
    # Newton-Schulz sees one matrix per expert: the stacks contribute E blocks each.
    experts = [r for r in plan.routes if r.kind == "expert_stack"]
    assert sum(r.num_blocks for r in experts) == len(experts) * config.n_routed_experts


def test_optim_plan_command_prints_every_parameter_and_model_info_totals(capsys):
    import argparse
    from pathlib import Path

    from orthon.launch import cmd_optim_plan
    from orthon.core.errors import ConfigError
    from orthon.pretrain.recipe import load_recipe
    from orthon.pretrain.model_info import meta_model, parameter_counts

    recipe = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
    parser = argparse.ArgumentParser()
    cmd_optim_plan.register(parser, "optim-plan")
    assert cmd_optim_plan.run(parser.parse_args(["-c", str(recipe), "optim.head_to_muon=true"]), "optim-plan") == 0
    out = capsys.readouterr().out
    model_config = load_recipe(recipe).model
    names = [name for name, _ in meta_model(model_config).named_parameters()]
    for name in names:
        assert f"\n{name} " in out
    total = sum(c["total"] for c in parameter_counts(model_config).values())
    assert f" total: {len(names):5d} parameters  {total:>18,} elements" in out
    assert "lm_head.weight                                        muon" in out
    with pytest.raises(ConfigError, match="optim.bogus: unknown key"):
        cmd_optim_plan.run(parser.parse_args(["-c", str(recipe), "optim.bogus=1"]), "optim-plan")
