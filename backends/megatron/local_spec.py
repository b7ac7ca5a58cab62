"""orthon's modules in megatron-core's local (no transformer-engine) layer spec, for tensor and sequence
parallelism there (``model.block_spec`` puts them in).

SequenceParallelRMSNorm: megatron's torch-norm fallback (``WrappedTorchNorm``) refuses sequence
parallelism, which megatron requires with tensor parallelism and MoE, so without transformer-engine or Apex
tensor parallelism could not run. A norm is per token, so it computes the same whether the tokens are
split over the TP ranks or not; what sequence parallelism needs is its weight marked ``sequence_parallel``,
as transformer-engine's norm marks it: each rank's gradient then covers its own tokens only and is summed
over the TP group after the backward (megatron's grad finalisation, and orthon's Trainer through
MegatronCausalLM.finish_grads).

ReplicatedLinear: MLA's down-projections, see there."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    def __init__(self, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                 zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise NotImplementedError("SequenceParallelRMSNorm: plain RMSNorm only (GLM-5's)")
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


class ReplicatedLinear(torch.nn.Module):
    """MLA's down-projections whole on every TP rank, as transformer-engine's spec has them (TELinear with
    ``parallel_mode="duplicated"``), for the local spec. megatron-core 0.16's local spec splits them by
    columns, and there the rope key's gradient is wrong under TP: its shared k_pos_emb is gathered over the
    TP ranks and each rank's heads give it a partial gradient, but the gather's backward keeps this rank's
    slice instead of summing the partials (the replicated branch gathers it over the sequence, whose
    backward sums). Under sequence parallelism the input is this rank's tokens, so the weight's gradient is
    partial too: marked ``sequence_parallel``, summed over TP after the backward. megatron's MLA accepts the
    module in TELinear's place (``compat.apply``)."""

    def __init__(self, input_size: int, output_size: int, *, config, init_method, bias: bool = False,
                 skip_bias_add: bool = False, is_expert: bool = False, parallel_mode=None, tp_group=None,
                 tp_comm_buffer_name=None, skip_weight_param_allocation: bool = False):
        super().__init__()
        if bias or is_expert or skip_weight_param_allocation:
            raise NotImplementedError("ReplicatedLinear: MLA's bias-free down-projections only")
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype, device=device))
        init_method(self.weight)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x):
        return F.linear(x, self.weight), None


def replace_torch_norms(spec) -> None:
    """Every WrappedTorchNorm in a (deep-copied) layer or block spec becomes SequenceParallelRMSNorm."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def visit(obj, seen):
        if id(obj) in seen or not hasattr(obj, "__dict__"):
            return
        seen.add(id(obj))
        for name, value in vars(obj).items():
            if value is WrappedTorchNorm:
                setattr(obj, name, SequenceParallelRMSNorm)
            elif isinstance(value, ModuleSpec) or (hasattr(value, "__dataclass_fields__") and not isinstance(value, type)):
                visit(value, seen)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    visit(item, seen)

    visit(spec, set())


def use_replicated_down_projections(layer_spec) -> None:
    """A (deep-copied) MLA layer spec's q / kv down-projections made ReplicatedLinear."""
    attention = layer_spec.submodules.self_attention.submodules
    attention.linear_q_down_proj = attention.linear_kv_down_proj = ReplicatedLinear
