"""Mixture of experts: sigmoid router with selection bias (aux-loss-free balancing), grouped routed
experts, one always-on shared expert. Names and layouts as transformers' GlmMoeDsaMoE."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as collectives
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor

import orthon.pretrain.fused_kernels as fused_kernels
from orthon.pretrain.config import ModelConfig
from orthon.pretrain.layers import MLP, compute_dtype


def route(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
    norm_topk_prob: bool, scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """noaux_tc routing. logits: (N, E) fp32 -> (weights (N, k), expert indices (N, k)).

    The bias shifts which experts are chosen, never the weights they get: weights are the plain
    sigmoid scores of the chosen experts (normalised to sum 1 if norm_topk_prob), times scaling.
    """
    scores = logits.sigmoid()
    choice = scores + bias
    if n_group > 1:
        N, E = choice.shape
        grouped = choice.view(N, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(N, E)
    indices = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, indices


def update_expert_bias(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower the over-loaded.
    bias_i += rate * sign(mean(load) - load_i). Returns the new bias."""
    return bias + rate * torch.sign(load.float().mean() - load.float())


def _grouped_mm_applies(x: torch.Tensor) -> bool:
    if not (x.is_cuda and hasattr(F, "grouped_mm")):
        return False
    return x.dtype == torch.bfloat16 or (torch.is_autocast_enabled("cuda")
                                         and torch.get_autocast_dtype("cuda") == torch.bfloat16)


def sort_by_expert(indices: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, expert) pairs of a routing, grouped by expert. indices: (N, k) ->
    order (N*k,) (positions in indices.reshape(-1)), token (N*k,) (the row of each pair), counts (E,)."""
    flat = indices.reshape(-1)
    order = flat.argsort(stable=True)
    return order, order // indices.shape[1], torch.bincount(flat, minlength=num_experts)


# oneDNN, torch's bf16 / fp16 GEMM on CPU, builds a kernel for each new matrix shape it meets (about 2 ms,
# against 0.1 ms for the product itself), and the rows each expert receives change every step. Padding
# them to a multiple of this (zero-weight rows) leaves a few shapes that repeat: the tiny model's MoE
# step under bf16 autocast is slower than fp32 without it. (fp32 runs on MKL, which builds nothing.)
EXPERT_ROW_MULTIPLE = 64


def _pads_expert_rows(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and compute_dtype(x) in (torch.bfloat16, torch.float16)


def pad_expert_rows(token: torch.Tensor, weights: torch.Tensor, counts: torch.Tensor, multiple: int):
    """sort_by_expert's rows with each expert's run padded to a multiple of ``multiple``: (token, weights,
    counts) of the padded layout. A padding row reads token 0 with weight 0, so it adds nothing to the
    output or to any gradient."""
    padded = (counts + multiple - 1) // multiple * multiple
    expert = torch.repeat_interleave(torch.arange(len(counts), device=counts.device), counts)
    shift = (padded.cumsum(0) - padded) - (counts.cumsum(0) - counts)  # each run's padded start - its start
    position = torch.arange(len(token), device=token.device) + shift[expert]
    total = int(padded.sum())
    return (token.new_zeros(total).index_copy_(0, position, token),
            weights.new_zeros(total).index_copy(0, position, weights), padded)


def combine_experts(x: torch.Tensor, token: torch.Tensor, order: torch.Tensor, weights: torch.Tensor | None,
                    ys: torch.Tensor) -> torch.Tensor:
    """Sum the expert outputs ys (N*k, H), in sort_by_expert's order, into their rows, each times its
    routing weight (weights None: ys are weighted already). Returns (N, H) in x's dtype."""
    if weights is not None:
        ys = ys * weights.reshape(-1)[order, None].to(ys.dtype)
    return torch.zeros_like(x).index_add_(0, token, ys.to(x.dtype))


def _swiglu_grads(h: torch.Tensor, grad_act: torch.Tensor, out: torch.Tensor) -> None:
    """d/dh of silu(g) * u (h = [g, u]) given the gradient of the product, written into ``out``."""
    g, u = h.chunk(2, dim=-1)
    torch.mul(grad_act, F.silu(g), out=out[:, g.shape[1]:])
    torch.ops.aten.silu_backward.grad_input(grad_act.mul_(u), g, grad_input=out[:, : g.shape[1]])


class _ExpertLoop(torch.autograd.Function):
    """The routed experts' SwiGLU on tokens sorted by expert, each output row times its routing weight,
    one matmul pair per expert, with a hand-written backward. Autograd's version of the same loop splits
    the input, unbinds the stacked weights and concatenates the outputs, and in backward concatenates and
    stacks them all again (three copies of the activations and one of both weight stacks per layer),
    and weights the outputs in separate passes over all of them; here every matmul writes its slice of
    a preallocated result and the weighting runs on that slice while it is still in cache. Experts
    without tokens still run on zero rows and get a zero gradient: every parameter takes part in every
    step (DDP and FSDP see the same gradients on every rank)."""

    @staticmethod
    def forward(ctx, xs, gate_up, down, weights, counts):
        ctx.dtypes = (xs.dtype, gate_up.dtype, down.dtype, weights.dtype)
        dtype = compute_dtype(xs)  # autocast's, as F.linear would run under it
        with torch.autocast(xs.device.type, enabled=False):
            return _ExpertLoop._forward(ctx, xs.to(dtype), gate_up.to(dtype), down.to(dtype), weights.to(dtype),
                                        counts)

    @staticmethod
    def _forward(ctx, xs, gate_up, down, weights, counts):
        rows = [0]
        for n in counts:
            rows.append(rows[-1] + n)
        two_i = gate_up.shape[1]
        h = xs.new_empty(xs.shape[0], two_i)
        act = xs.new_empty(xs.shape[0], two_i // 2)
        ys = xs.new_empty(xs.shape[0], down.shape[1])
        fused = fused_kernels.applies(h, act)
        for e in range(len(counts)):
            a, b = rows[e], rows[e + 1]
            torch.mm(xs[a:b], gate_up[e].t(), out=h[a:b])
            g, u = h[a:b].chunk(2, dim=-1)
            if fused:
                fused_kernels.swiglu_into(g, u, act[a:b])
            else:
                torch.mul(F.silu(g), u, out=act[a:b])
            torch.mm(act[a:b], down[e].t(), out=ys[a:b]).mul_(weights[a:b, None])
        ctx.save_for_backward(xs, gate_up, down, weights, h, act)
        ctx.rows = rows
        return ys

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_ys):
        xs, gate_up, down, weights, h, act = ctx.saved_tensors
        rows = ctx.rows
        grad_ys = grad_ys.to(xs.dtype).contiguous()
        need_x, need_gu, need_down, need_w = ctx.needs_input_grad[:4]
        grad_x = torch.empty_like(xs) if need_x else None
        grad_gu = torch.empty_like(gate_up) if need_gu else None
        grad_down = torch.empty_like(down) if need_down else None
        grad_w = torch.empty_like(weights) if need_w else None
        grad_h = torch.empty_like(h)
        fused = fused_kernels.applies(h, act, grad_ys, weights[:, None])
        for e in range(len(rows) - 1):
            a, b = rows[e], rows[e + 1]
            gy, w = grad_ys[a:b], weights[a:b, None]
            grad_act = gy @ down[e]  # of the unweighted product act @ down^T, before the weight
            if fused:  # the next five lines in one pass
                fused_kernels.expert_act_backward_(grad_act, act[a:b], weights[a:b], h[a:b], grad_h[a:b],
                                                   grad_w[a:b] if need_w else None)
                if need_down:
                    torch.mm(gy.t(), act[a:b], out=grad_down[e])
            else:
                if need_w:
                    torch.sum(grad_act * act[a:b], dim=-1, out=grad_w[a:b])
                if need_down:
                    torch.mm(gy.t(), act[a:b].mul_(w), out=grad_down[e])  # act is not needed after this
                _swiglu_grads(h[a:b], grad_act.mul_(w), grad_h[a:b])
            if need_gu:
                torch.mm(grad_h[a:b].t(), xs[a:b], out=grad_gu[e])
            if need_x:
                torch.mm(grad_h[a:b], gate_up[e], out=grad_x[a:b])
        grads = (grad_x, grad_gu, grad_down, grad_w)
        return (*(None if g is None else g.to(d) for g, d in zip(grads, ctx.dtypes)), None)


def grouped_experts(
    x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Routed-expert SwiGLU, computed expert by expert over the tokens sorted by expert.

    x: (N, H); indices/weights: (N, k); gate_up: (E, 2I, H) (gate rows then up rows); down: (E, H, I).
    One matmul pair per expert that received tokens (grouped GEMM on CUDA), never a loop over tokens.
    """
    order, token, counts = sort_by_expert(indices, gate_up.shape[0])
    if _grouped_mm_applies(x):
        xs = x.index_select(0, token)
        # torch's grouped GEMM takes bf16 only: the bf16 forward (or autocast) uses it, fp32 loops.
        bf16 = torch.bfloat16
        offs = counts.cumsum(0).to(torch.int32)
        h = F.grouped_mm(xs.to(bf16), gate_up.to(bf16).transpose(1, 2), offs=offs)
        g, u = h.chunk(2, dim=-1)
        ys = F.grouped_mm(F.silu(g) * u, down.to(bf16).transpose(1, 2), offs=offs)
        return combine_experts(x, token, order, weights, ys)
    weights = weights.reshape(-1)[order]
    if _pads_expert_rows(x):
        token, weights, counts = pad_expert_rows(token, weights, counts, EXPERT_ROW_MULTIPLE)
    ys = _ExpertLoop.apply(x.index_select(0, token), gate_up, down, weights, counts.tolist())
    return combine_experts(x, token, order, None, ys)


# The expert-parallel mesh's dimensions (orthon.pretrain.expert_parallel): the experts of a layer are spread
# along "experts"; the ranks along "expert_replicas" hold the same experts (data parallelism among them).
EXPERT_MESH_DIMS = ("expert_replicas", "experts")


def exchanged_experts(
    x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, gate_up: DTensor, down: DTensor
) -> torch.Tensor:
    """grouped_experts under expert parallelism: the stacks are DTensors sharded by expert over the mesh's
    "experts" dimension (ep ranks, E / ep consecutive experts each). Each (token, expert) pair's row goes to
    the rank holding the expert, each rank runs its experts on the rows it received, and the outputs come
    back to be weighted and summed where their tokens live: one all-to-all of the rows and one of the
    outputs a layer, each mirrored in backward (autograd through both), plus one of the counts. Every rank
    of the expert group must run the layer together, as it does in a training step."""
    group = gate_up.device_mesh.get_group(EXPERT_MESH_DIMS[1])
    local_gate_up, local_down = gate_up.to_local(), down.to_local()
    ep, per_rank = dist.get_world_size(group), local_gate_up.shape[0]
    order, token, counts = sort_by_expert(indices, ep * per_rank)
    received = torch.empty_like(counts)  # (source rank, my expert): the pairs each rank sends each of mine
    dist.all_to_all_single(received, counts, group=group)
    # Rows to each rank and from each rank, read to the host in one sync (the all-to-alls take lists).
    send, receive = torch.stack((counts, received)).view(2, ep, per_rank).sum(2).tolist()
    rows = collectives.all_to_all_single_autograd(x.index_select(0, token), receive, send, group)
    # Rows arrive by source rank, each source's sorted by expert: the local expert of each.
    mine = torch.arange(per_rank, device=x.device).repeat(ep).repeat_interleave(received)
    ys = grouped_experts(rows, mine[:, None], rows.new_ones(len(mine), 1), local_gate_up, local_down)
    outputs = collectives.all_to_all_single_autograd(ys, send, receive, group)
    return combine_experts(x, token, order, weights, outputs)


class Router(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts))
        # Tokens routed to each expert since the trainer last read it (for the bias update).
        self.register_buffer("expert_load", torch.zeros(config.n_routed_experts), persistent=False)

    def forward(self, x: torch.Tensor):
        c = self.config
        logits = F.linear(x.float(), self.weight.float())
        weights, indices = route(
            logits, self.e_score_correction_bias.float(), c.num_experts_per_tok, c.n_group, c.topk_group,
            c.norm_topk_prob, c.routed_scaling_factor,
        )
        if self.training:
            with torch.no_grad():
                self.expert_load += torch.bincount(indices.reshape(-1), minlength=c.n_routed_experts)
        return weights, indices


class Experts(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        E, H, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x, indices, weights):
        if isinstance(self.gate_up_proj, DTensor):  # expert parallelism (orthon.pretrain.expert_parallel)
            return exchanged_experts(x, indices, weights, self.gate_up_proj, self.down_proj)
        return grouped_experts(x, indices, weights, self.gate_up_proj, self.down_proj)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.experts = Experts(config)
        self.gate = Router(config)
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config.hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(flat)
        routed = self.experts(flat, indices, weights).view_as(x)
        return routed if self.shared_experts is None else routed + self.shared_experts(x)
