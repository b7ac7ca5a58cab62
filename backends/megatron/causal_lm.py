"""megatron-core's GPTModel as the one Trainer's model (``backend: megatron``).

The Trainer (orthon.pretrain.trainer) asks a model for a forward with labels that returns the summed or
mean next-token loss, its MoE routers' token counts and selection biases (the aux-loss-free balancing
step), its indexers (none here: megatron's model is dense MLA, as pretraining is), and, through this
class, for its weights and optimizer. ``MegatronCausalLM`` gives megatron-core's model that face, so
pretraining runs the same data, batch ramp, schedule, checkpoints and metrics on either backend.

- Weights come in and go out in orthon's format (the HF layout, ``orthon.backends.megatron.weights``).
  A run from scratch starts from the weights orthon's torch model draws for the same seed, converted,
  so both backends start alike (``megatron.init: orthon``; ``megatron`` lets megatron draw each rank's
  part, for models no rank can hold whole). The DSA indexer is not part of megatron's dense-MLA model: its tensors
  are carried beside it (buffers, in every checkpoint) and written back with the weights, untrained,
  as pretraining leaves them on the torch backend too.
- GLM-5 gives its two latent norms (q_a / kv_a) eps 1e-6 where megatron has one ``layernorm_epsilon``
  (rms_norm_eps) for all: the two are set back to 1e-6 after the build, so the model computes GLM-5's
  function (the logits and loss equal the torch model's on the same weights).
- The parameters stay fp32 and ``train.precision: bf16`` runs the forward under autocast, as on the torch
  backend (megatron's own bf16 mode would step bf16 parameters through main weights the checkpoint does
  not hold).
- Without CUDA it runs on the CPU (``orthon.backends.megatron.model.build_model``): a tiny recipe trains on
  a laptop.

The Trainer drives it data parallel (DDP over megatron's data-parallel group), tensor parallel with
megatron's sequence parallelism (``megatron.tensor_parallel``), expert parallel
(``megatron.expert_parallel``) and pipeline parallel (``megatron.pipeline_parallel``: megatron's 1F1B
schedule runs each step's micro-batches, ``train_micro_batches``, interleaved over model chunks with
``megatron.virtual_pipeline_parallel``; see ``orthon.backends.megatron.pipeline``),
through the hooks ``data_parallel``, ``ddp_group``, ``finish_grads``, ``clip_grads`` and
``checkpoint_names`` below. FSDP2 and context parallelism are refused by name."""
from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from orthon.backends.megatron import grads, pipeline
from orthon.backends.megatron.checks import check_recipe, check_world
from orthon.backends.megatron.convert import megatron_shapes, orthon_to_megatron
from orthon.backends.megatron.core_attention import SDPACoreAttention
from orthon.backends.megatron.gathered_weights import save_gathered, stage_parts, weight_parts, whole_state
from orthon.backends.megatron.reshard import rebuild
from orthon.backends.megatron.model import (build_chunks, load_megatron_state, rank_key, require_megatron, sizes_of,
                                            stage_sizes)
from orthon.backends.megatron.parallel import global_expert_name, global_layer_name, stage_name
from orthon.backends.megatron.weights import load_as_megatron
from orthon.core.errors import ConfigError
from orthon.pretrain.config import ModelConfig
from orthon.pretrain.loss import IGNORE_INDEX, cross_entropy
from orthon.pretrain.model import CausalLMOutput, GLMForCausalLM
from orthon.pretrain.recipe import MegatronOptions

LATENT_NORM_EPS = 1e-6  # GLM-5's q_a / kv_a latent norms (orthon.pretrain.attention)
_LATENT_NORMS = (("q_layernorm", "linear_q_up_proj"), ("kv_layernorm", "linear_kv_up_proj"))


class _RouterView:
    """A megatron TopKRouter as the Trainer's balancing step reads a router: the tokens each expert took
    since the last step (``expert_load``) and the bias added to the scores for selection only."""

    def __init__(self, router):
        self.router = router

    @property
    def expert_load(self) -> torch.Tensor:
        return self.router.local_tokens_per_expert

    @property
    def e_score_correction_bias(self) -> torch.Tensor:
        return self.router.expert_bias


class _OtherStageRouter:
    """A MoE layer another pipeline stage holds, as this rank shows it to the balancing step: no tokens, and a
    bias no forward here reads. Every rank lists every MoE layer, so the step's sums over the ranks pair the
    same layers and give each its own stage's counts."""

    def __init__(self, experts: int, device):
        self.expert_load = torch.zeros(experts, device=device)
        self.e_score_correction_bias = torch.zeros(experts, device=device)


class MegatronCausalLM(nn.Module):
    """megatron-core's GPTModel of ``config`` (built by ``orthon.backends.megatron.model``), with the
    face orthon's Trainer asks of a model (orthon.pretrain.backend_model.BackendModel). ``recipe``: the
    training recipe (its ``megatron`` section, ``runtime`` and seed)."""

    def __init__(self, recipe):
        super().__init__()
        require_megatron()
        check_recipe(recipe)
        self.config: ModelConfig = recipe.model
        self.runtime = dataclasses.replace(recipe.runtime)
        self.options: MegatronOptions = dataclasses.replace(recipe.megatron, params_dtype="fp32")
        check_world(sizes_of(self.options))
        # this rank's model chunks: one, or one per virtual pipeline stage (megatron.virtual_pipeline_parallel)
        self.chunks = build_chunks(self.config, self.options, recompute=self.runtime.activation_checkpointing)
        self.gpt = self.chunks[0]
        for c, chunk in enumerate(self.chunks[1:], start=1):
            self.add_module(f"gpt_chunk{c}", chunk)
        for chunk in self.chunks:
            for layer in chunk.decoder.layers:
                _set_latent_eps(layer.self_attention, LATENT_NORM_EPS)
        from megatron.core import parallel_state

        sizes = sizes_of(self.options)
        self.pipeline_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.stages = [rank_key(c)[0] for c in range(len(self.chunks))]  # each chunk's stage of stage_sizes
        self.layers_per_stage = self.config.num_hidden_layers // stage_sizes(self.options).pp
        self.pipelined = sizes.pp > 1
        if self.pipelined:
            pipeline.configure(self.gpt.config, interleaved=len(self.chunks) > 1)
        self._in_schedule, self._forwards, self._chunk = False, 0, 0  # _chunk: the chunk a forward runs
        self._common_shape: tuple[int, int] | None = None  # (rows, positions) every forward of the interleaved schedule runs at
        self._stage_max_logit: torch.Tensor | None = None
        # orthon's core attention modules of the local spec (they keep the largest attention logit; TE's
        # exposes none), found once: under pipeline parallelism they are read every micro-batch
        self._attentions = [m for chunk in self.chunks for m in chunk.modules() if isinstance(m, SDPACoreAttention)]
        self._other_stage_routers: dict[int, _OtherStageRouter] = {}
        # megatron's names and shapes of the full model (orthon's, built on the meta device: no memory,
        # converted); those of this stage's tensors megatron's model has no module for (the DSA indexer)
        # are carried beside it, buffers of ``carried``
        shapes = megatron_shapes(self.config, self.runtime, self.gpt.orthon_layout)
        self._names = set(shapes)
        built = {self.global_name(n, c) for c, chunk in enumerate(self.chunks) for n in chunk.state_dict()}
        carried = sorted(n for n in shapes if stage_name(n, self.layers_per_stage)[0] in self.stages and n not in built
                         and not global_expert_name(n, 0, 1, self.gpt.orthon_layout))
        self._carried_names = {name: f"t{i}" for i, name in enumerate(carried)}
        self.carried = nn.Module()
        for name, key in self._carried_names.items():
            self.carried.register_buffer(key, torch.zeros(shapes[name]))
        if recipe.train.init_from:
            return  # the Trainer loads it next
        if self.options.init == "orthon":
            torch.manual_seed(recipe.train.seed)  # the torch backend's first draw: the same initial weights
            orthon_state = GLMForCausalLM(self.config, runtime=self.runtime).state_dict()
            self._load_full(orthon_to_megatron(orthon_state, self.config, self.gpt.orthon_layout))
        else:  # megatron drew its own; the carried tensors by orthon's rule (normal matrices, unit norm scales)
            generator = torch.Generator().manual_seed(recipe.train.seed)
            for name, key in self._carried_names.items():
                tensor = getattr(self.carried, key)
                if tensor.dim() > 1:
                    tensor.normal_(0.0, self.config.initializer_range, generator=generator)
                elif name.endswith(".weight"):
                    tensor.fill_(1.0)

    @property
    def carried_by_key(self) -> dict[str, str]:
        """{buffer name in ``carried``: megatron's name} of the tensors carried beside megatron's model."""
        return {key: name for name, key in self._carried_names.items()}

    def global_name(self, name: str, chunk: int = 0) -> str:
        """The whole model's name of tensor ``name`` of model chunk ``chunk`` (megatron numbers a stage's layers
        from 0)."""
        return global_layer_name(name, self.stages[chunk], self.layers_per_stage)

    def _chunk_prefix(self, chunk: int) -> str:
        """The chunk's name in this module (its state-dict prefix)."""
        return "gpt" if chunk == 0 else f"gpt_chunk{chunk}"

    # ------------------------------------------------------------ weights
    def _load_full(self, full: dict[str, torch.Tensor]) -> None:
        """megatron's full state dict into the model, the tensors it has no module for into ``carried``."""
        for c, chunk in enumerate(self.chunks):
            load_megatron_state(chunk, full, self.config, self.options, c)
        for name, key in self._carried_names.items():
            getattr(self.carried, key).copy_(full[name])

    def load_weights(self, directory) -> None:
        """A weights directory (orthon's, or any HF glm_moe_dsa checkpoint of this architecture) into the model."""
        _, full = load_as_megatron(directory, self.gpt.orthon_layout)
        device = next(self.parameters()).device
        self._load_full({k: v.to(device) for k, v in full.items()})

    def local_states(self) -> dict[tuple[int, int, int], dict[str, torch.Tensor]]:
        """This rank's parts of megatron's state dict, {``rank_key`` of a chunk: its state (its stage's
        names)}, the carried tensors included."""
        states = {rank_key(c): {k: v.detach() for k, v in chunk.state_dict().items()
                                if self.global_name(k, c) in self._names}  # no router counters
                  for c, chunk in enumerate(self.chunks)}
        for name, key in self._carried_names.items():
            stage, local = stage_name(name, self.layers_per_stage)
            states[rank_key(self.stages.index(stage))][local] = getattr(self.carried, key)
        return states

    def weight_parts(self, part_bytes: int, owner=lambda i: 0) -> list:
        """The model in orthon's names in parts of about ``part_bytes``, as loaders (a collective where the
        ranks hold parts of it: every rank calls each in turn); the i-th returns its part on rank
        ``owner(i)``, None elsewhere (``gathered_weights.weight_parts``)."""
        return weight_parts(self, part_bytes, owner)

    def whole_state(self, owner: int = 0) -> dict | None:
        """The whole model in orthon's names on rank ``owner``, None elsewhere (a collective where the ranks
        hold parts of it)."""
        return whole_state(self, owner)

    def stage_parts(self, part_bytes: int):
        """With pipeline stages, this rank's stage's parts, gathered within the stage to its leader
        (``gathered_weights.stage_parts``); None without."""
        return stage_parts(self, part_bytes)

    def save_weights(self, directory, write: bool = True) -> None:
        """The model as an orthon weights directory (HF layout + sidecar), written where ``write`` (rank 0);
        under tensor, expert or pipeline parallelism a collective (every rank calls it) that gathers one
        part of the model at a time (``gathered_weights``)."""
        save_gathered(self, directory, write)

    def build_optimizer(self, recipe):
        """orthon's Muon + Split / AdamW over megatron's parameters (orthon.backends.megatron.optimizer)."""
        from orthon.backends.megatron.optimizer import build_optimizer

        named = _NamedParameters([(self.global_name(n, c), p) for c, chunk in enumerate(self.chunks)
                                  for n, p in chunk.named_parameters()])
        return build_optimizer(named, self.config, recipe.optim, recipe.schedule, tp=sizes_of(self.options).tp)

    # ------------------------------------------------------------ tensor and expert parallelism
    @property
    def tensor_parallel(self) -> int:
        return sizes_of(self.options).tp

    @property
    def expert_parallel(self) -> int:
        return sizes_of(self.options).ep

    @property
    def model_parallel(self) -> bool:
        """The ranks hold parts of the model (tensor, expert or pipeline parallelism)."""
        return sizes_of(self.options).splits_model

    def data_parallel(self) -> tuple[int, int]:
        """(rank, size) of this process among the data-parallel replicas: a TP group's ranks read the same
        batches (megatron orders the ranks TP first, so these are rank // TP and world // TP)."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()

    def ddp_group(self):
        """The process group DDP averages over: megatron's data-parallel group (None: the world, without TP)."""
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group() if self.tensor_parallel > 1 else None

    def check_step(self, step) -> None:
        """The Trainer's step plug-in must suit the layout: under expert parallelism every forward runs on
        every rank (each MoE layer's exchange waits for all of them). Micro-batches of any shape do:
        ``forward`` pads them where the layout needs one (``_padded_shape``)."""
        if self.expert_parallel > 1 and not step.runs_expert_parallel:
            raise ConfigError(f"megatron.expert_parallel = {self.expert_parallel}: {type(step).__name__} does not run "
                              f"every forward on every rank; set megatron.expert_parallel=1")

    def parameter_parts(self):
        """(chunk, name in it, parameter, is an expert's, split over its tensor-parallel group) of every parameter."""
        return grads.parameter_parts(self)

    def finish_grads(self) -> None:
        """After the step's backward: what DDP leaves to megatron's parallelism (``grads.finish_grads``)."""
        grads.finish_grads(self)

    def clip_grads(self, max_norm: float) -> float:
        """The whole model's gradients clipped to ``max_norm``, each element counted once; the norm
        (``grads.clip_grads``). Every rank calls it."""
        return grads.clip_grads(self, max_norm)

    def layout(self) -> dict[str, int]:
        """megatron's sizes this model is cut by (saved with each checkpoint)."""
        sizes = {key: getattr(self.options, key)  # expert_tensor_parallel None: as tensor_parallel
                 for key in ("tensor_parallel", "pipeline_parallel", "virtual_pipeline_parallel", "expert_parallel",
                             "expert_tensor_parallel")}
        return {**sizes, "transformer_engine": "on" if self.gpt.orthon_layout.te else "off"}  # the layers' names

    def resharding(self, saved: dict | None, path):
        """How the checkpoint at ``path``, written at layout ``saved``, loads here: None where this layout
        wrote it (``saved`` None: a checkpoint from before layouts were saved), else ``reshard.rebuild`` for
        this model (each rank's tensors rebuilt from the pieces of the other layout's ranks). Written with
        the other layer spec (transformer-engine's or the local one), whose tensors are named otherwise: a
        ConfigError naming the way across."""
        mine = self.layout()
        if saved is None or saved == mine:
            return None
        if saved.get("transformer_engine") != mine["transformer_engine"]:
            raise ConfigError(f"{path} was written with transformer-engine's layer spec {saved.get('transformer_engine')} "
                              f"(this run: {mine['transformer_engine']}), whose tensors are named otherwise: resume "
                              f"where it was written, or carry its weights across (orthon export RUN --step N --out "
                              f"DIR, then train.init_from=DIR; the optimizer state starts afresh)")
        return functools.partial(rebuild, self)

    def checkpoint_names(self) -> dict[str, str]:
        """{name in this rank's state dict: name in a checkpoint} where they differ, so that the ranks' keys
        differ wherever their tensors do (DCP keeps one copy of a key): an expert under expert parallelism
        by its index in the model (each rank numbers its experts from 0), a tensor split over a
        tensor-parallel group with its rank there (``@tp1``), a pipeline stage's layers by their number in
        the model (each stage numbers its layers from 0), its carried tensors by their names and its
        optimizer's param groups under a key of its own. A checkpoint so resumes at the same layout."""
        if not self.model_parallel:
            return {}
        from megatron.core import parallel_state

        per_rank = self.config.n_routed_experts // self.expert_parallel
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        tp_rank = {False: parallel_state.get_tensor_model_parallel_rank(), True: parallel_state.get_expert_tensor_parallel_rank()}
        names = {f"{self._chunk_prefix(c)}.{name}": self.global_name(name, c)  # buffers too (the routers' biases)
                 for c, chunk in enumerate(self.chunks) for name in chunk.state_dict()}
        for c, name, _, expert, split in self.parameter_parts():
            full = (global_expert_name(name, ep_rank, per_rank, self.gpt.orthon_layout) if expert else None) or name
            names[f"{self._chunk_prefix(c)}.{name}"] = self.global_name(full, c) + (f"@tp{tp_rank[expert]}" if split else "")
        renamed = {name: f"gpt.{full}" for name, full in names.items() if f"gpt.{full}" != name}
        if self.pipelined:  # a stage's carried tensors and its optimizer's param groups are its own
            renamed.update({f"carried.{key}": f"carried.{name}" for name, key in self._carried_names.items()})
            renamed["param_groups"] = f"param_groups@stage{self.pipeline_rank}"
        return renamed

    # ------------------------------------------------------------ the Trainer's model face
    def forward(self, input_ids, labels=None, doc_ids=None, return_logits: bool = True, loss_reduction: str = "mean",
                loss_chunk: int = 0, context=None, position_ids=None, logits_at=None) -> CausalLMOutput:
        """As GLMForCausalLM.forward for whole sequences from position 0 (no cache, no documents, no context
        parallelism). Without logits the loss is megatron's own (its fused cross-entropy). Under pipeline
        parallelism a training step's forwards run in ``train_micro_batches``; one outside it runs through
        the schedule forward only (``_through_pipeline``)."""
        if doc_ids is not None or context is not None:
            raise ValueError("MegatronCausalLM: packed documents and context parallelism are not supported")
        if self.pipelined and not self._in_schedule:
            return self._through_pipeline(input_ids, labels=labels, return_logits=return_logits,
                                          loss_reduction=loss_reduction, position_ids=position_ids, logits_at=logits_at)
        if self.pipelined:
            self._forwards += 1
            if not pipeline.is_last_stage(self.chunks[self._chunk]):  # the step's loss is the last stage's to compute
                raise pipeline.StageOutput(self._stage_output(input_ids, position_ids))
        B, T = input_ids.shape
        input_ids, labels, position_ids = self._padded(input_ids, labels, position_ids)
        if labels is not None and not return_logits and logits_at is None:
            counted = labels != IGNORE_INDEX
            per_token = self.chunks[self._chunk](input_ids, position_ids, None, labels=labels.masked_fill(~counted, 0))
            loss = per_token.float().masked_fill(~counted, 0.0).sum()
            if loss_reduction == "mean":
                loss = loss / counted.sum().clamp(min=1)
            return CausalLMOutput(logits=None, loss=loss)
        logits = self.chunks[self._chunk](input_ids, position_ids, None, runtime_gather_output=True)[:B, :T]  # the whole vocabulary
        labels = None if labels is None else labels[:B, :T]
        if logits_at is not None:
            logits = logits.gather(1, logits_at[..., None].expand(*logits_at.shape, logits.shape[-1]))
        loss = cross_entropy(logits, labels, loss_reduction) if labels is not None else None
        return CausalLMOutput(logits=logits, loss=loss)

    def _padded(self, input_ids, labels, position_ids):
        """(input_ids, labels, position_ids) at the shape the forward runs at (``_padded_shape``): padding on
        the right and below (the forward takes it off the logits again), positions counting on."""
        B, T = input_ids.shape
        rows, length = self._common_shape or self._padded_shape(B, T)
        if B > rows or T > length:
            raise ValueError(f"megatron.virtual_pipeline_parallel: a forward of {B} x {T} in a step whose "
                             f"micro-batches run at {rows} x {length} (the step plug-in's input_shape is too small)")
        if (rows, length) != (B, T):
            input_ids = F.pad(input_ids, (0, length - T, 0, rows - B))
            labels = None if labels is None else F.pad(labels, (0, length - T, 0, rows - B), value=IGNORE_INDEX)
            if position_ids is not None:
                position_ids = F.pad(position_ids, (0, length - T, 0, rows - B))
                position_ids[:, T:] = position_ids[:, T - 1 : T] + torch.arange(1, length - T + 1, device=input_ids.device)
        if position_ids is None:
            position_ids = torch.arange(length, device=input_ids.device)[None].expand(rows, -1)
        return input_ids, labels, position_ids

    # ------------------------------------------------------------ pipeline parallelism
    def _stage_output(self, input_ids, position_ids=None) -> torch.Tensor:
        """A stage before the last: its layers' output for these sequences (the first stage embeds them; a
        later one takes what megatron's schedule received from the stage before)."""
        input_ids, _, position_ids = self._padded(input_ids, None, position_ids)
        return self.chunks[self._chunk](input_ids, position_ids, None)

    def _schedule(self, micros: list, step_loss, shape: tuple[int, int] = (1, 1), forward_only: bool = False) -> list[dict]:
        best = [None]  # this stage's largest attention logit over the micro-batches (when tracked)

        def keep_max_logit():
            latest = self._local_max_logit()
            if latest is not None:
                best[0] = latest if best[0] is None else torch.maximum(best[0], latest)

        def once(micro):  # the stages split one forward of the model: a loss must call it once a micro-batch
            self._forwards = 0
            try:
                result = step_loss(micro)
            finally:
                keep_max_logit()
            if self._forwards != 1:
                raise ValueError(f"megatron.pipeline_parallel = {sizes_of(self.options).pp}: a step's loss called the "
                                 f"model {self._forwards} times for one micro-batch; under pipeline parallelism it "
                                 f"calls it once (the stages run that forward between them)")
            return result

        def use(chunk):
            self._chunk = next(c for c, mine in enumerate(self.chunks) if mine is chunk)

        self._in_schedule, self._stage_max_logit = True, None
        try:
            sums = pipeline.run(self.chunks, micros, once, use, shape, forward_only)
        finally:
            self._in_schedule, self._chunk, self._common_shape = False, 0, None
        self._stage_max_logit = best[0]
        return sums

    def train_micro_batches(self, step, micros: list) -> list[dict]:
        """A training step's micro-batches through megatron's pipeline schedule (1F1B): forwards and backwards,
        the step plug-in's loss run on every stage (before the last it ends at the model's call, see
        ``pipeline.StageOutput``). Returns each micro-batch's metric sums, on every stage. The interleaved
        schedule runs at least PP micro-batches: a step with fewer gets empty ones where its loss takes them
        (a weight-0 forward)."""
        pp = sizes_of(self.options).pp
        if len(self.chunks) > 1 and len(micros) < pp and step.takes_empty_micro_batches:
            micros = micros + [[] for _ in range(pp - len(micros))]
        return self._schedule(micros, lambda micro: step.loss(self, micro),
                              self._interleaved_shape([step.input_shape(m) for m in micros]))

    def _interleaved_shape(self, shapes: list[tuple[int, int]]) -> tuple[int, int]:
        """(positions, rows) every micro-batch runs at under megatron's interleaved schedule, which runs at least
        PP of them and sizes its exchange by one shape: the largest of the micro-batches' input ``shapes``
        (rows, positions), each padded to it (``_padded``); (1, 1) without it (each sent with its own)."""
        self._common_shape = None
        if len(self.chunks) == 1:
            return 1, 1
        pp, vp = sizes_of(self.options).pp, len(self.chunks)
        if len(shapes) < pp:
            raise ConfigError(f"megatron.virtual_pipeline_parallel = {vp}: megatron's interleaved schedule runs at "
                              f"least {pp} micro-batches (the pipeline stages); this step has {len(shapes)} on each "
                              f"data-parallel replica. Train with a batch of at least {pp} micro-batches on each "
                              f"replica, or set megatron.virtual_pipeline_parallel=1")
        self._common_shape = self._padded_shape(max(r for r, _ in shapes), max(t for _, t in shapes))
        rows, length = self._common_shape
        return length, rows

    @torch.no_grad()
    def _through_pipeline(self, input_ids, **kwargs) -> CausalLMOutput:
        """A forward outside a training step under pipeline parallelism (held-out losses, RL's log-probs):
        through the schedule, forward only; the loss and logits the last stage computes are sent to every
        stage (the logits in fp32)."""
        if torch.is_grad_enabled():
            raise ValueError(f"megatron.pipeline_parallel = {sizes_of(self.options).pp}: the model's gradients come "
                             f"from a training step's schedule (Trainer.train_step), not from a forward outside it")
        outputs = []

        def last_stage(_):
            out = self(input_ids, **kwargs)
            outputs.append(out)
            return (out.loss if out.loss is not None else out.logits.new_zeros(())), {}
        # megatron's interleaved schedule runs micro-batches in groups of PP: the same one PP times there
        pp = sizes_of(self.options).pp if len(self.chunks) > 1 else 1
        copies = [SimpleNamespace(input_ids=input_ids)] * pp
        self._schedule(copies, last_stage, self._interleaved_shape([tuple(input_ids.shape)] * pp), forward_only=True)
        loss = logits = None
        if kwargs.get("labels") is not None:
            loss = pipeline.from_last_stage(outputs[0].loss.float() if outputs else None, (), input_ids.device)
        if kwargs.get("return_logits", True) or kwargs.get("logits_at") is not None:
            at = kwargs.get("logits_at")
            shape = (*(input_ids.shape if at is None else at.shape), self.config.vocab_size)
            logits = pipeline.from_last_stage(outputs[0].logits.float() if outputs else None, shape, input_ids.device)
        return CausalLMOutput(logits=logits, loss=loss)

    def _padded_shape(self, rows: int, length: int) -> tuple[int, int]:
        """The shape a forward of ``rows`` x ``length`` runs at: sequence parallelism splits the positions over
        TP, so a multiple of TP; megatron's allgather dispatcher (without CUDA) gathers every expert-parallel
        rank's tokens as equal parts, so under expert parallelism the largest of the ranks' shapes (a
        collective: every rank runs each forward, as the step plug-ins that run expert parallel do). The
        padding sits after the real positions (causal attention: they never see it) and below the real rows."""
        if self.expert_parallel > 1 and self.gpt.config.moe_token_dispatcher_type == "allgather":
            from megatron.core import parallel_state

            shape = torch.tensor([rows, length], device=next(self.parameters()).device)
            dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=parallel_state.get_expert_tensor_and_model_parallel_group())
            rows, length = (int(x) for x in shape.tolist())
        return rows, length + (-length % self.tensor_parallel)

    def moe_routers(self) -> list:
        """Every MoE layer's router, in layer order; under pipeline parallelism the layers other stages hold
        too (``_OtherStageRouter``), so every rank lists the same layers."""
        mine = {layer.layer_number - 1: _RouterView(layer.mlp.router)
                for chunk in self.chunks for layer in chunk.decoder.layers if hasattr(layer.mlp, "router")}
        if not self.pipelined:
            return list(mine.values())
        device = next(self.parameters()).device
        for layer in range(self.config.num_hidden_layers):
            if self.config.is_moe_layer(layer) and layer not in mine:
                mine[layer] = self._other_stage_routers.setdefault(layer, _OtherStageRouter(self.config.n_routed_experts, device))
        return [mine[layer] for layer in sorted(mine)]

    def indexers(self) -> list:
        return []

    def set_indexers_trainable(self, trainable: bool) -> None:
        if trainable:
            raise ConfigError("the megatron backend has no DSA indexer to train (mid-training runs on the torch backend)")

    def track_max_logit(self, on: bool = True) -> None:
        """Keep each layer's largest attention logit (orthon's core attention of megatron's local spec;
        transformer-engine's attention does not expose its logits: there the metric is not logged)."""
        for module in self._attentions:
            module.track_max_logit, module.max_logit = on, None
        self._stage_max_logit = None

    def _local_max_logit(self) -> torch.Tensor | None:
        values = [m.max_logit for m in self._attentions if m.max_logit is not None]
        return torch.stack(values).max() if values else None

    def attention_logit_max(self) -> torch.Tensor | None:
        """The largest attention logit of the last forward over this rank's layers; under pipeline
        parallelism, once a schedule has run, over its micro-batches (a stage before the last ends the
        step's loss at the model's call, before the step reads this: the step reads it at its end and
        takes the largest over the ranks)."""
        if self._stage_max_logit is not None:
            return self._stage_max_logit
        return self._local_max_logit()


class _NamedParameters:
    """The chunks' parameters under the whole model's names, as the optimizer's builder reads a module."""

    def __init__(self, pairs: list):
        self.pairs = pairs

    def named_parameters(self):
        return iter(self.pairs)


def _set_latent_eps(attention, eps: float) -> None:
    """GLM-5's eps on MLA's two latent norms: a norm module of its own (local spec), or the one fused into
    the up-projection after it (transformer-engine's LayerNormColumnParallelLinear)."""
    for norm, fused in _LATENT_NORMS:
        module = getattr(attention, norm, None)
        if module is None or not hasattr(module, "eps"):
            module = getattr(attention, fused)
        module.eps = eps
