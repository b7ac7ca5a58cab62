"""The face another framework's model shows the one Trainer (``recipe.backend``; the Trainer's
MODEL_BACKENDS names each by dotted path, so the Trainer never imports a backend).

Besides GLMForCausalLM's training face (``forward(input_ids, labels=..., return_logits=False,
loss_reduction=..., logits_at=...)`` returning a CausalLMOutput, ``moe_routers()`` whose items have
``expert_load`` and ``e_score_correction_bias``, ``indexers()``, ``runtime``, ``set_indexers_trainable``,
``track_max_logit``, ``attention_logit_max``), such a model brings its own weights I/O, optimizer and model
parallelism: the methods below. ``orthon.backends.megatron.causal_lm.MegatronCausalLM`` is the one there is."""
from __future__ import annotations

from typing import Protocol


class BackendModel(Protocol):
    pipelined: bool
    """The model runs a step's micro-batches through a pipeline schedule (``train_micro_batches``); the
    Trainer then leaves it unwrapped (no DDP) and the model averages its gradients in ``finish_grads``."""

    def load_weights(self, directory) -> None:
        """An orthon weights directory into the model (each rank its part)."""

    def save_weights(self, directory, write: bool = True) -> None:
        """The model as an orthon weights directory, written where ``write``; a collective where the ranks
        hold parts of it."""

    model_parallel: bool
    """The ranks hold parts of the model (no rank holds all of it)."""

    def weight_parts(self, part_bytes: int, owner=lambda i: 0) -> list:
        """The model in orthon's names in parts of about ``part_bytes``, as loaders: calling the i-th, on every
        rank in turn (a collective where the ranks hold parts), returns on rank ``owner(i)`` that part,
        {name: CPU tensor} (a routed-expert stack larger than a part as row pieces of whole experts,
        ``hf_io.row_piece_name``), None elsewhere."""

    def whole_state(self, owner: int = 0) -> dict | None:
        """The whole model in orthon's names on rank ``owner``, None elsewhere (a collective where the ranks
        hold parts of it)."""

    def stage_parts(self, part_bytes: int):
        """Where the model runs in pipeline stages, this rank's stage's parts (``stage``, ``stages``,
        ``loaders``, ``leader``): the stage's ranks call its loaders together, each part gathered within the
        stage to its leader, which receives {name: CPU tensor}; None without stages."""

    def build_optimizer(self, recipe):
        """The optimizer (orthon's HybridOptimizer) over the model's parameters."""

    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) among the data-parallel replicas: the ranks of one replica read the same batches."""

    def ddp_group(self):
        """The process group DDP averages gradients over (None: the world)."""

    def check_step(self, step) -> None:
        """A ConfigError where the step plug-in does not suit the model's parallelism."""

    def train_micro_batches(self, step, micros: list) -> list[dict]:
        """Where ``pipelined``: forwards and backwards of ``micros`` with the step plug-in's loss; each
        micro-batch's metric sums, the same on every rank of a replica."""

    def finish_grads(self) -> None:
        """After the step's backward: the gradients DDP left to the model's own parallelism."""

    def clip_grads(self, max_norm: float) -> float:
        """Clip the whole model's gradients to ``max_norm`` (each element counted once); returns the norm."""

    def layout(self) -> dict:
        """How the ranks split the model (saved with each checkpoint)."""

    def resharding(self, saved: dict | None, path):
        """None where the checkpoint at ``path`` was written at this layout (``saved``); else
        ``rebuild(targets, path, stored)``, which fills this rank's tensors the checkpoint holds as other pieces
        (orthon.pretrain.checkpoint.Checkpointer.load); a ConfigError where it cannot be resumed here."""

    def checkpoint_names(self) -> dict[str, str]:
        """{state-dict name: checkpoint name} where the ranks' state dicts use one name for different
        tensors (orthon.pretrain.checkpoint keeps one copy of a name)."""
