"""Parameter counts per component, total and active per token, from the config alone (meta device)."""
from __future__ import annotations

from collections import defaultdict

from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.model import GLMForCausalLM, on_meta_device
from orthon.pretrain.parallel import check_shard_ranks

COMPONENTS = ("embedding", "attention", "indexer", "dense_mlp", "router", "routed_experts", "shared_experts",
              "norms", "output_head")


def component_of(name: str) -> str:
    if name.startswith("model.embed_tokens"):
        return "embedding"
    if name.startswith("lm_head"):
        return "output_head"
    if ".indexer." in name:
        return "indexer"
    if ".self_attn." in name:
        return "norms" if "layernorm" in name else "attention"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp.gate." in name:
        return "router"
    if ".mlp." in name:
        return "dense_mlp"
    return "norms"


def meta_model(config: ModelConfig, runtime: RuntimeOptions | None = None) -> GLMForCausalLM:
    """The torch model of ``config`` on the meta device: names, shapes and ParamSpecs, no memory."""
    with on_meta_device():
        return GLMForCausalLM(config, init=False, runtime=runtime)


def parameter_counts(config: ModelConfig) -> dict[str, dict[str, int]]:
    """{component: {"total": n, "active": n}}; routed experts are active top-k of n_routed per token."""
    model = meta_model(config)
    counts = defaultdict(lambda: {"total": 0, "active": 0})
    for name, p in model.named_parameters():
        comp = component_of(name)
        counts[comp]["total"] += p.numel()
        active = p.numel()
        if comp == "routed_experts":
            active = p.numel() * config.num_experts_per_tok // config.n_routed_experts
        counts[comp]["active"] += active
    return {c: dict(counts[c]) for c in COMPONENTS if c in counts}


BYTES_PER_PARAM = 16  # training state: fp32 weights + gradients + two optimizer moments (AdamW; Muon keeps one)


def rank_parameters(counts: dict[str, dict[str, int]], world: int, train=None, megatron=None) -> float:
    """Parameters one of ``world`` ranks holds to train under ``train`` (a TrainConfig; None: DDP). FSDP2
    shards all of them over the ranks, or over groups of ``fsdp_shard_ranks`` (HSDP), expert parallelism
    included (it shards each rank's experts over the ranks holding the same ones); under DDP every rank
    holds everything but the routed experts, which expert parallelism spreads over its ranks. ``megatron``:
    the recipe's MegatronOptions where megatron-core trains it (its tensor parallelism splits the rest, its
    expert parallelism and the experts' TP the routed experts, its pipeline parallelism the layers: a
    stage holds 1 / PP of them and the larger of the embedding and the output head)."""
    if megatron is not None:
        tp, ep, pp = megatron.tensor_parallel, megatron.expert_parallel, megatron.pipeline_parallel
        etp = megatron.expert_tensor_parallel or tp
        size = {name: c["total"] for name, c in counts.items()}
        experts = size.get("routed_experts", 0)
        ends = (size.get("embedding", 0), size.get("output_head", 0))
        layers = sum(size.values()) - experts - sum(ends)
        return (layers / pp + (max(ends) if pp > 1 else sum(ends))) / tp + experts / (pp * ep * etp)
    parallel = getattr(train, "parallel", "ddp")
    ep = getattr(train, "expert_parallel", 1)
    shard_ranks = getattr(train, "fsdp_shard_ranks", 0)
    total = sum(c["total"] for c in counts.values())
    experts = counts.get("routed_experts", {"total": 0})["total"]
    if world == 1:
        return total
    check_shard_ranks(shard_ranks, world)
    if parallel == "fsdp":  # expert parallelism shards the experts over the world whatever the groups
        return (total - experts) / (shard_ranks or world) + experts / (world if ep > 1 else shard_ranks or world)
    return total - experts + experts / ep


def format_rank_share(counts, world: int, train) -> str:
    n = rank_parameters(counts, world, train)
    hsdp = f", train.fsdp_shard_ranks={train.fsdp_shard_ranks}" if train.parallel == "fsdp" and train.fsdp_shard_ranks else ""
    return (f"one rank of {world} (train.parallel={train.parallel}{hsdp}, train.expert_parallel={train.expert_parallel}): "
            f"{n / 1e9:,.2f}B parameters, {n * BYTES_PER_PARAM / 1e9:,.1f} GB of training state "
            f"({BYTES_PER_PARAM} bytes each: fp32 weights, gradients, optimizer state; activations not counted)")


def format_counts(counts: dict[str, dict[str, int]]) -> str:
    def human(n):
        return f"{n / 1e9:,.2f}B" if n >= 1e9 else f"{n / 1e6:,.2f}M"

    lines = [f"{'component':<16}{'total':>14}{'active':>14}"]
    for comp, c in counts.items():
        lines.append(f"{comp:<16}{human(c['total']):>14}{human(c['active']):>14}")
    total = sum(c["total"] for c in counts.values())
    active = sum(c["active"] for c in counts.values())
    lines.append(f"{'TOTAL':<16}{human(total):>14}{human(active):>14}")
    embed = sum(counts.get(c, {"active": 0})["active"] for c in ("embedding", "output_head"))
    lines.append(f"(exact: {total:,} total, {active:,} active per token; "
                 f"{human(active - embed)} active without embedding and output head)")
    return "\n".join(lines)
