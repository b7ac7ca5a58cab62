"""Mixture of experts as MindSpore cells (names and layouts as orthon.pretrain.moe): the sigmoid router
with its selection-only bias, routed experts stacked (E, 2I, H) / (E, H, I), one shared expert.

Two ways to run the routed experts, the same function: ``grouped`` (PyNative: tokens sorted by expert,
one matmul pair per expert that received tokens, as the torch model) and ``dense`` (every expert on
every token, weighted by the routing; static shapes, for graph mode, at E / top_k times the FLOPs).
The router's per-expert token counts are returned beside the output (the trainer's balancing step
reads them), not kept as cell state, so the forward stays a pure function of its inputs."""
from __future__ import annotations

from orthon.backends.mindspore.layers import MLP, linear, zeros_param
from orthon.backends.mindspore.runtime import ms
from orthon.pretrain.config import ModelConfig

ops, nn = ms.ops, ms.nn


def route(logits, bias, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool, scaling: float):
    """noaux_tc routing: logits (N, E) -> (weights (N, k), expert indices (N, k)); the bias shifts which
    experts are chosen, never their weights."""
    scores = ops.sigmoid(logits)
    choice = scores + bias
    if n_group > 1:
        N, E = choice.shape
        grouped = choice.reshape(N, n_group, E // n_group)
        group_scores = ops.topk(grouped, 2)[0].sum(-1)
        keep = ops.tensor_scatter_elements(
            ops.zeros((N, n_group), ms.int32), ops.topk(group_scores, topk_group)[1].astype(ms.int32),
            ops.ones((N, topk_group), ms.int32), 1) > 0
        choice = ops.masked_fill(grouped, ops.logical_not(keep.expand_dims(-1)), float("-inf")).reshape(N, E)
    indices = ops.topk(ops.stop_gradient(choice), top_k)[1]
    weights = ops.gather_elements(scores, 1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * scaling, indices


def grouped_experts(x, indices, weights, gate_up, down):
    """Routed SwiGLU over the tokens sorted by expert (dynamic shapes: PyNative). x (N, H), indices and
    weights (N, k), gate_up (E, 2I, H), down (E, H, I) -> (N, H)."""
    N, k = indices.shape
    E = gate_up.shape[0]
    flat = indices.reshape(-1).astype(ms.int32)
    # Sort the (token, expert) pairs by expert, ties by position (a stable sort through distinct keys).
    keys = flat.astype(ms.int64) * (N * k) + ops.arange(N * k, dtype=ms.int64)
    order = ops.sort(keys)[1]
    token = order // k
    counts = ops.bincount(flat, minlength=E).asnumpy().astype(int).tolist()
    xs = ops.gather(x, token, 0)
    gate_ups, downs = ops.unstack(gate_up, 0), ops.unstack(down, 0)
    pieces, start = [], 0
    for e, count in enumerate(counts):
        if count:
            h = linear(xs[start : start + count], gate_ups[e])
            half = h.shape[-1] // 2
            pieces.append(linear(ops.silu(h[:, :half]) * h[:, half:], downs[e]))
            start += count
    ys = ops.cat(pieces, 0) * ops.gather(weights.reshape(-1), order, 0).expand_dims(-1)
    return ops.index_add(ops.zeros_like(x), token.astype(ms.int32), ys, 0)


def dense_experts(x, indices, weights, gate_up, down):
    """The same function with every expert on every token (static shapes: graph mode)."""
    E = gate_up.shape[0]
    mix = (ops.one_hot(indices, E, ms.Tensor(1.0, ms.float32), ms.Tensor(0.0, ms.float32))
           * weights.expand_dims(-1)).sum(1)  # (N, E)
    h = ops.matmul(x.expand_dims(0), gate_up.transpose(0, 2, 1))  # (E, N, 2I)
    half = h.shape[-1] // 2
    ys = ops.matmul(ops.silu(h[..., :half]) * h[..., half:], down.transpose(0, 2, 1))  # (E, N, H)
    return (ys * mix.T.expand_dims(-1)).sum(0)


class Router(nn.Cell):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = zeros_param(config.n_routed_experts, config.hidden_size)
        # A buffer in the torch model: saved with the weights, moved by the trainer, never trained.
        self.e_score_correction_bias = zeros_param(config.n_routed_experts, requires_grad=False)

    def construct(self, x):
        c = self.config
        return route(linear(x, self.weight), self.e_score_correction_bias, c.num_experts_per_tok, c.n_group,
                     c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)


class Experts(nn.Cell):
    def __init__(self, config: ModelConfig):
        super().__init__()
        E, H, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = zeros_param(E, 2 * I, H)
        self.down_proj = zeros_param(E, H, I)
        self.grouped = True  # False: dense_experts (graph mode)

    def construct(self, x, indices, weights):
        run = grouped_experts if self.grouped else dense_experts
        return run(x, indices, weights, self.gate_up_proj, self.down_proj)


class MoE(nn.Cell):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.experts = Experts(config)
        self.gate = Router(config)
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config.hidden_size, shared) if shared else None
        self.num_experts = config.n_routed_experts

    def construct(self, x):
        """x (B, T, H) -> (output, tokens routed to each expert (E,) float32)."""
        flat = x.reshape(-1, x.shape[-1])
        weights, indices = self.gate(flat)
        out = self.experts(flat, indices, weights).reshape(x.shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        load = ops.one_hot(indices.reshape(-1), self.num_experts, ms.Tensor(1.0, ms.float32),
                           ms.Tensor(0.0, ms.float32)).sum(0)
        return out, ops.stop_gradient(load)
