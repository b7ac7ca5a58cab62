"""The gradients of the megatron backend's model (``MegatronCausalLM``) after a step's backward: what DDP
leaves to megatron's parallelism (sums over tensor- and expert-parallel groups, the pipeline's own
data-parallel average) and the clipping norm over every rank's pieces, each element counted once."""
from __future__ import annotations

import torch
import torch.distributed as dist

from orthon.backends.megatron.model import sizes_of


def parameter_parts(model):
    """(chunk, name in it, parameter, is an expert's, split over its tensor-parallel group) of every parameter."""
    tp = {"dense": model.tensor_parallel, "expert": sizes_of(model.options).expert_tp}
    for c, chunk in enumerate(model.chunks):
        for name, p in chunk.named_parameters():
            expert = ".mlp.experts." in name
            yield c, name, p, expert, bool(getattr(p, "tensor_model_parallel", False)) and tp["expert" if expert else "dense"] > 1


@torch.no_grad()
def finish_grads(model) -> None:
    """After the step's backward (DDP has averaged over the data-parallel group what it holds):
    - sequence parallelism: a norm's or router's gradient covers this rank's tokens only; summed over TP;
    - expert parallelism: DDP leaves the experts alone (megatron marks them allreduce False); their
      gradients already hold the tokens every rank of their expert-parallel group sent them, and the
      ranks holding the same experts (the expert data-parallel group) add theirs, as data parallelism's
      average (each rank's loss is scaled for that average over the data-parallel replicas)."""
    from megatron.core import parallel_state

    replicas = parallel_state.get_data_parallel_world_size()
    if model.pipelined and replicas > 1:  # not wrapped in DDP (the schedule runs the micro-batches)
        grads = [p.grad for p in model.parameters() if p.grad is not None and getattr(p, "allreduce", True)]
        average(grads, parallel_state.get_data_parallel_group(), replicas)
    if model.tensor_parallel > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        for p in model.parameters():
            if p.grad is not None and getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad, group=group)
    if model.expert_parallel > 1:
        group = parallel_state.get_expert_data_parallel_group()
        for p in model.parameters():
            if p.grad is not None and getattr(p, "allreduce", True) is False:
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(p.grad, group=group)
                p.grad.div_(replicas)


@torch.no_grad()
def clip_grads(model, max_norm: float) -> float:
    """torch's clip_grad_norm_ over the whole model's gradients, each element counted once: a split
    tensor's squares added over its tensor-parallel group, a copy counted on that group's first rank,
    the experts' over the expert tensor-and-expert-parallel group, the stages' over the pipeline group;
    returns the norm. Every rank calls it."""
    params = [p for p in model.parameters() if p.grad is not None]
    if not model.model_parallel:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    from megatron.core import parallel_state

    first = {False: parallel_state.get_tensor_model_parallel_rank() == 0,
             True: parallel_state.get_expert_tensor_parallel_rank() == 0}
    squares = {False: torch.zeros((), device=params[0].grad.device), True: torch.zeros((), device=params[0].grad.device)}
    for _, _, p, expert, split in parameter_parts(model):
        if p.grad is not None and (split or first[expert]):
            squares[expert] += p.grad.detach().float().pow(2).sum()
    dist.all_reduce(squares[False], group=parallel_state.get_tensor_model_parallel_group())
    dist.all_reduce(squares[True], group=parallel_state.get_expert_tensor_and_model_parallel_group())
    total = squares[False] + squares[True]
    if model.pipelined:  # each stage's own layers
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    norm = total.sqrt()
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if coefficient < 1:
        for p in params:
            p.grad.mul_(coefficient.to(p.grad.dtype))
    return float(norm)


@torch.no_grad()
def average(grads: list[torch.Tensor], group, size: int, bucket: int = 1 << 26) -> None:
    """The gradients averaged over ``group`` (``size`` ranks), in buckets of about ``bucket`` elements
    (one all-reduce a bucket rather than one a tensor)."""
    start = 0
    while start < len(grads):
        end, elements = start, 0
        while end < len(grads) and (end == start or elements + grads[end].numel() <= bucket):
            elements += grads[end].numel()
            end += 1
        flat = torch.cat([g.reshape(-1) for g in grads[start:end]])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in grads[start:end]:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        start = end
