"""The Trainer's micro-batches through megatron-core's pipeline schedule (``megatron.pipeline_parallel`` > 1).

Each rank holds one stage's layers; megatron's 1F1B schedule (``get_forward_backward_func``) runs the
step's micro-batches through them, sending activations forward and their gradients back between stages.
The step plug-in's loss runs on the last stage, where the model's forward ends in the loss; the other
stages run their layers alone (``stage_forward``). Every stage of a replica reads the same micro-batches
(the data-parallel rank excludes the pipeline), and the last stage's metric sums are sent to the others,
so every rank returns the same sums, as tensor-parallel ranks do.

megatron sizes each micro-batch's exchange per micro-batch (``variable_seq_lengths``), so micro-batches
may differ in shape, and takes the objective as the plug-in returns it (``calculate_per_token_loss``: no
division by the number of micro-batches; the plug-in already divides by the step's normaliser).

Without CUDA the schedule runs on the CPU over gloo (``compat.point_cuda_device_at_cpu``: megatron makes
a counter on "cuda" and synchronises CUDA around its shape exchange)."""
from __future__ import annotations

import torch.distributed as dist


def configure(config) -> None:
    """megatron's TransformerConfig set for the Trainer's schedule (see the module docstring)."""
    config.variable_seq_lengths = True
    config.calculate_per_token_loss = True


def is_last_stage() -> bool:
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage()


def run(gpt, micros: list, last_stage, stage_forward, seq_length: int, micro_batch_size: int,
        forward_only: bool = False) -> list[dict]:
    """Run ``micros`` through the pipeline. On the last stage ``last_stage(micro)`` gives (the objective to
    backward, that micro-batch's metric sums); on the others ``stage_forward(micro)`` the stage's output.
    ``seq_length`` / ``micro_batch_size``: the first micro-batch's shape (megatron exchanges each one's
    own). Returns the metric sums of every micro-batch, on every stage (a collective over the pipeline
    group)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    last = is_last_stage()
    sums: list[dict] = []

    def forward_step(data_iterator, model):
        micro = next(data_iterator)
        if not last:
            return stage_forward(micro), None
        objective, micro_sums = last_stage(micro)
        sums.append(micro_sums)
        return objective, lambda output: (output, 1, {})

    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micros), model=[gpt],
                                num_microbatches=len(micros), seq_length=seq_length,
                                micro_batch_size=micro_batch_size, forward_only=forward_only)
    plain = [[{k: float(v) for k, v in s.items()} for s in sums]]  # one transfer, then sent as objects
    group = parallel_state.get_pipeline_model_parallel_group()
    dist.broadcast_object_list(plain, src=parallel_state.get_pipeline_model_parallel_last_rank(), group=group)
    return plain[0]
