"""The Trainer's micro-batches through megatron-core's pipeline schedule (``megatron.pipeline_parallel`` > 1).

Each rank holds one stage's layers; megatron's 1F1B schedule (``get_forward_backward_func``) runs the
step's micro-batches through them, sending activations forward and their gradients back between stages.
Every stage runs the step plug-in's loss on the same micro-batch (the stages of a replica read the same
batches): on the last stage the model's forward ends in the loss and the plug-in goes on as without a
pipeline; on an earlier stage the model's forward runs its layers and raises ``StageOutput`` with their
output, which ends the plug-in's loss there and goes to the schedule. So any step plug-in runs pipelined
(pretraining's, RL's, SFT's) if its loss calls the model once a micro-batch, before any side effect. The
last stage's metric sums are sent to the others, so every rank returns the same sums, as tensor-parallel
ranks do.

megatron sizes each micro-batch's exchange per micro-batch (``variable_seq_lengths``), so micro-batches
may differ in shape (RL's are sized by their samples), and takes the objective as the plug-in returns it
(``calculate_per_token_loss``: no division by the number of micro-batches; the plug-in already divides by
the step's normaliser). With several model chunks a rank (``megatron.virtual_pipeline_parallel``) the
schedule is megatron's interleaved 1F1B: micro-batches of one shape (``configure``; the model pads each to
the step's largest), at least PP of them, in groups of PP (or one group, where PP does not divide them:
more micro-batches in flight, no bubble megatron refuses).

Without CUDA the schedule runs on the CPU over gloo (``compat.point_cuda_device_at_cpu``: megatron makes
a counter on "cuda" and synchronises CUDA around its shape exchange)."""
from __future__ import annotations

import torch
import torch.distributed as dist


class StageOutput(Exception):
    """A stage before the last has run its layers for a micro-batch: their output, carried out of the step
    plug-in's loss (which only the last stage can compute) to the schedule."""

    def __init__(self, output: torch.Tensor):
        super().__init__("a pipeline stage's output")
        self.output = output


def configure(config, interleaved: bool) -> None:
    """megatron's TransformerConfig set for the Trainer's schedule (see the module docstring). megatron's
    interleaved schedule exchanges shapes in a pattern its neighbours do not match (it hangs): there every
    micro-batch has the one shape ``run`` is given."""
    config.variable_seq_lengths = not interleaved
    config.calculate_per_token_loss = True
    # The interleaved schedule sends to both neighbours at once; with two stages they are one rank, and one
    # batch of sends and receives matches an activation with a gradient. Its one-at-a-time exchange sends
    # the two directions over two communicators (what megatron's training loop picks for interleaving).
    config.batch_p2p_comm = not interleaved


def is_last_stage(chunk) -> bool:
    """Whether model chunk ``chunk`` (a GPTModel) ends the pipeline (with a virtual pipeline: the last chunk
    of the last rank)."""
    from megatron.core import parallel_state

    return parallel_state.is_pipeline_last_stage(ignore_virtual=chunk.vp_stage is None, vp_stage=chunk.vp_stage)


def run(chunks: list, micros: list, step_loss, use_chunk, shape: tuple[int, int] = (1, 1),
        forward_only: bool = False) -> list[dict]:
    """Run ``micros`` through the pipeline of this rank's model ``chunks`` (several: megatron's interleaved
    schedule): ``use_chunk(chunk)`` then ``step_loss(micro)``, which gives (the objective to backward, that
    micro-batch's metric sums) on the last stage and raises StageOutput on the others. ``shape``: (positions,
    rows) of every micro-batch, which the interleaved schedule's exchange is sized by (the other sends each
    micro-batch's own shape first). Returns the metric sums of every micro-batch, on every stage (a
    collective over the pipeline group)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    sums: list[dict] = []

    def forward_step(data_iterator, model):
        use_chunk(model)
        try:
            objective, micro_sums = step_loss(next(data_iterator))
        except StageOutput as stage:
            return stage.output, None
        sums.append(micro_sums)
        return objective, lambda output: (output, 1, {})

    if len(chunks) > 1:  # groups of PP, or all in one where PP does not divide them (megatron takes [PP, M])
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        chunks[0].config.microbatch_group_size_per_vp_stage = pp if len(micros) % pp == 0 else len(micros)
    iterators = [iter(micros) for _ in chunks]  # each chunk runs every micro-batch
    get_forward_backward_func()(forward_step_func=forward_step,
                                data_iterator=iterators if len(chunks) > 1 else iterators[0], model=chunks,
                                num_microbatches=len(micros), seq_length=shape[0], micro_batch_size=shape[1],
                                forward_only=forward_only)
    plain = [[{k: float(v) for k, v in s.items()} for s in sums]]  # one transfer, then sent as objects
    dist.broadcast_object_list(plain, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                               group=parallel_state.get_pipeline_model_parallel_group())
    return plain[0]


def from_last_stage(tensor: torch.Tensor | None, shape: tuple, device) -> torch.Tensor:
    """The last stage's fp32 ``tensor`` of ``shape`` on every stage (None where this is not the last)."""
    from megatron.core import parallel_state

    if tensor is None:
        tensor = torch.empty(shape, dtype=torch.float32, device=device)
    tensor = tensor.contiguous()
    dist.broadcast(tensor, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                   group=parallel_state.get_pipeline_model_parallel_group())
    return tensor

