"""megatron-core's GPTModel as the one Trainer's model (``backend: megatron``).

The Trainer (orthon.pretrain.trainer) asks a model for a forward with labels that returns the summed or
mean next-token loss, its MoE routers' token counts and selection biases (the aux-loss-free balancing
step), its indexers (none here: megatron's model is dense MLA, as pretraining is), and, through this
class, for its weights and optimizer. ``MegatronCausalLM`` gives megatron-core's model that face, so
pretraining runs the same data, batch ramp, schedule, checkpoints and metrics on either backend.

- Weights come in and go out in orthon's format (the HF layout, ``orthon.backends.megatron.weights``).
  A run from scratch starts from the weights orthon's torch model draws for the same seed, converted,
  so both backends start alike. The DSA indexer is not part of megatron's dense-MLA model: its tensors
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

The Trainer drives it data parallel (DDP) and with megatron's expert parallelism (``megatron.expert_parallel``:
the hooks ``finish_grads``, ``clip_grads`` and ``checkpoint_names`` below); tensor and pipeline parallelism,
FSDP2 and context parallelism are refused by name (tensor parallelism with MoE needs megatron's sequence
parallelism, which its torch-norm fallback without transformer-engine does not support; pipeline
parallelism needs megatron's schedules)."""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import nn

from orthon.backends.megatron.convert import megatron_to_orthon, model_maps, orthon_to_megatron
from orthon.backends.megatron.model import build_model, load_megatron_state, require_megatron, sizes_of
from orthon.backends.megatron.parallel import global_expert_name, merge
from orthon.backends.megatron.weights import load_as_megatron, save_from_megatron
from orthon.core.errors import ConfigError
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.loss import IGNORE_INDEX, cross_entropy
from orthon.pretrain.model import CausalLMOutput, GLMForCausalLM
from orthon.pretrain.recipe import MegatronOptions

LATENT_NORM_EPS = 1e-6  # GLM-5's q_a / kv_a latent norms (orthon.pretrain.attention)
_LATENT_NORMS = (("q_layernorm", "linear_q_up_proj"), ("kv_layernorm", "linear_kv_up_proj"))


def check_recipe(recipe) -> None:
    """What the Trainer cannot yet run on megatron-core, refused before anything is built."""
    options, train = recipe.megatron, recipe.train
    sizes = sizes_of(options)
    if (sizes.tp, sizes.pp) != (1, 1):
        raise ConfigError(f"megatron.tensor_parallel / pipeline_parallel = {sizes.tp} / {sizes.pp}: the Trainer drives "
                          f"megatron-core with data and expert parallelism so far (set them to 1); "
                          f"orthon.backends.megatron converts and shards weights for those layouts")
    for name, value, plain in (("train.parallel", train.parallel, "ddp"), ("train.expert_parallel", train.expert_parallel, 1),
                               ("train.context_parallel", train.context_parallel, 1)):
        if value != plain:
            raise ConfigError(f"{name} = {value}: the megatron backend runs data parallel (DDP) and megatron's own expert "
                              f"parallelism (megatron.expert_parallel) so far; set {name}={plain}")
    if recipe.runtime.sparse_attention:
        raise ConfigError("runtime.sparse_attention: the megatron backend runs dense MLA (pretraining's attention); "
                          "DSA (mid-training) runs on the torch backend")
    if recipe.runtime.activation_checkpointing:
        raise ConfigError("runtime.activation_checkpointing: not wired to megatron-core's recompute yet; set it false")
    if recipe.data.document_mask:
        raise ConfigError("data.document_mask: megatron-core's local attention is plainly causal; packed documents "
                          "need transformer-engine's (not wired yet); set data.document_mask=false")


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


class MegatronCausalLM(nn.Module):
    """megatron-core's GPTModel of ``config`` (built by ``orthon.backends.megatron.model``), with the
    face orthon's Trainer asks of a model. ``recipe``: the training recipe (its ``megatron`` section,
    ``runtime`` and seed)."""

    def __init__(self, recipe):
        super().__init__()
        require_megatron()
        check_recipe(recipe)
        self.config: ModelConfig = recipe.model
        self.runtime = dataclasses.replace(recipe.runtime)
        self.options: MegatronOptions = dataclasses.replace(recipe.megatron, params_dtype="fp32")
        self.gpt = build_model(self.config, self.options)
        for layer in self.gpt.decoder.layers:
            _set_latent_eps(layer.self_attention, LATENT_NORM_EPS)
        # megatron's names of the full model; those of its tensors megatron's model has no module for (the
        # DSA indexer) are carried beside it, buffers of ``carried``
        self._names = {name for mp in model_maps(self.config, self.gpt.orthon_layout) for name in mp.megatron}
        built = set(self.gpt.state_dict())
        carried = sorted(n for n in self._names if n not in built and not global_expert_name(n, 0, 1, self.gpt.orthon_layout))
        self._carried_names = {name: f"t{i}" for i, name in enumerate(carried)}
        self.carried = nn.Module()
        torch.manual_seed(recipe.train.seed)  # the torch backend's first draw: the same initial weights
        self._load_full(self._full_state(GLMForCausalLM(self.config, runtime=self.runtime).state_dict()))

    # ------------------------------------------------------------ weights
    def _full_state(self, orthon_state: dict) -> dict[str, torch.Tensor]:
        return orthon_to_megatron(orthon_state, self.config, self.gpt.orthon_layout)

    def _load_full(self, full: dict[str, torch.Tensor]) -> None:
        """megatron's full state dict into the model, the tensors it has no module for into ``carried``."""
        load_megatron_state(self.gpt, full, self.config, self.options)
        for name, key in self._carried_names.items():
            if hasattr(self.carried, key):
                getattr(self.carried, key).copy_(full[name])
            else:
                self.carried.register_buffer(key, full[name].detach().clone().float())

    def load_weights(self, directory) -> None:
        """A weights directory (orthon's, or any HF glm_moe_dsa checkpoint of this architecture) into the model."""
        _, full = load_as_megatron(directory, self.gpt.orthon_layout)
        device = next(self.parameters()).device
        self._load_full({k: v.to(device) for k, v in full.items()})

    def full_state(self) -> dict[str, torch.Tensor]:
        """megatron's full state dict of the model: its own tensors and the carried ones. Under expert
        parallelism a collective (every rank calls it): the experts of every rank gathered, on every rank."""
        local = {k: v for k, v in self.gpt.state_dict().items() if k in self._names}  # no router counters, no TE state
        local.update({name: getattr(self.carried, key) for name, key in self._carried_names.items()})
        if self.expert_parallel == 1:
            return local
        from megatron.core import parallel_state

        group = parallel_state.get_expert_model_parallel_group()
        experts = {k: v.detach().cpu() for k, v in local.items() if global_expert_name(k, 0, 1, self.gpt.orthon_layout)}
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, experts, group=group)
        shards = {(0, 0, e): dict(state) for e, state in enumerate(gathered)}
        shards[(0, 0, 0)].update({k: v for k, v in local.items() if k not in experts})
        return merge(shards, self.config, sizes_of(self.options), self.gpt.orthon_layout)

    def orthon_state(self) -> dict[str, torch.Tensor]:
        """The model's tensors in orthon's names (GLMForCausalLM's state dict: what the engines and RL's
        weight syncs take), detached."""
        return {k: v.detach() for k, v in megatron_to_orthon(self.full_state(), self.config, self.gpt.orthon_layout).items()}

    def save_weights(self, directory, write: bool = True) -> None:
        """The model as an orthon weights directory (HF layout + sidecar), written where ``write``; under
        expert parallelism a collective (every rank calls it, one writes)."""
        state = self.full_state()
        if write:
            save_from_megatron(state, self.config, directory, self.gpt.orthon_layout, self.runtime)

    def build_optimizer(self, recipe):
        """orthon's Muon + Split / AdamW over megatron's parameters (orthon.backends.megatron.optimizer)."""
        from orthon.backends.megatron.optimizer import build_optimizer

        return build_optimizer(self.gpt, self.config, recipe.optim, recipe.schedule, tp=sizes_of(self.options).tp)

    # ------------------------------------------------------------ expert parallelism
    @property
    def expert_parallel(self) -> int:
        return sizes_of(self.options).ep

    def check_step(self, step) -> None:
        """The Trainer's step plug-in must suit the expert exchange: every forward on every rank, and (with
        megatron's allgather dispatcher, the one that runs without CUDA) one shape on every rank."""
        if self.expert_parallel == 1:
            return
        name, ep = type(step).__name__, self.expert_parallel
        if not step.runs_expert_parallel:
            raise ConfigError(f"megatron.expert_parallel = {ep}: {name} does not run every forward on every rank; "
                              f"set megatron.expert_parallel=1")
        if self.gpt.config.moe_token_dispatcher_type == "allgather" and not step.same_shapes:
            raise ConfigError(f"megatron.expert_parallel = {ep}: {name} sizes each micro-batch by its samples, and "
                              f"megatron's allgather token dispatcher (the one that runs without CUDA) needs one shape "
                              f"on every rank; on GPUs its alltoall dispatcher takes any (else set "
                              f"megatron.expert_parallel=1)")

    def _expert_params(self) -> list[nn.Parameter]:
        # megatron marks the weights its expert-parallel ranks hold apart (allreduce False): DDP leaves them
        # to finish_grads (orthon.pretrain.parallel.wrap)
        return [p for p in self.gpt.parameters() if getattr(p, "allreduce", True) is False]

    @torch.no_grad()
    def finish_grads(self, world: int) -> None:
        """After the step's backward: the experts' gradients as data parallelism's average over the ``world``
        ranks. Each rank's loss is scaled for that average and its experts' gradients already hold the
        tokens every rank of its expert-parallel group sent them; the ranks holding the same experts (the
        expert data-parallel group) add theirs."""
        if self.expert_parallel == 1:
            return
        from megatron.core import parallel_state

        group = parallel_state.get_expert_data_parallel_group()
        for p in self._expert_params():
            if p.grad is not None:
                if dist.get_world_size(group) > 1:
                    dist.all_reduce(p.grad, group=group)
                p.grad.div_(world)

    @torch.no_grad()
    def clip_grads(self, max_norm: float) -> float:
        """torch's clip_grad_norm_ over the whole model's gradients, each expert counted once (its rank's
        squares added over the expert-parallel group); returns the norm. Every rank calls it."""
        params = [p for p in self.parameters() if p.grad is not None]
        if self.expert_parallel == 1:
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        from megatron.core import parallel_state

        experts = {id(p) for p in self._expert_params()}
        device = params[0].grad.device
        squares = torch.zeros(2, dtype=torch.float32, device=device)  # [others, experts]
        for p in params:
            squares[int(id(p) in experts)] += p.grad.detach().float().pow(2).sum()
        expert_part = squares[1:].clone()
        dist.all_reduce(expert_part, group=parallel_state.get_expert_model_parallel_group())
        norm = (squares[0] + expert_part[0]).sqrt()
        coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        if coefficient < 1:
            for p in params:
                p.grad.mul_(coefficient.to(p.grad.dtype))
        return float(norm)

    def checkpoint_names(self) -> dict[str, str]:
        """{name in this rank's state dict: name in a checkpoint} where they differ: under expert parallelism
        each rank numbers its experts from 0, a checkpoint by their index in the model (so the ranks' keys
        differ and each rank's experts are kept, not taken for copies of one another)."""
        if self.expert_parallel == 1:
            return {}
        from megatron.core import parallel_state

        per_rank = self.config.n_routed_experts // self.expert_parallel
        rank = parallel_state.get_expert_model_parallel_rank()
        names = {}
        for name, _ in self.gpt.named_parameters():
            full = global_expert_name(name, rank, per_rank, self.gpt.orthon_layout)
            if full is not None:
                names[f"gpt.{name}"] = f"gpt.{full}"
        return names

    # ------------------------------------------------------------ the Trainer's model face
    def forward(self, input_ids, labels=None, doc_ids=None, return_logits: bool = True, loss_reduction: str = "mean",
                loss_chunk: int = 0, context=None, position_ids=None, logits_at=None) -> CausalLMOutput:
        """As GLMForCausalLM.forward for whole sequences from position 0 (no cache, no documents, no context
        parallelism). Without logits the loss is megatron's own (its fused cross-entropy)."""
        if doc_ids is not None or context is not None:
            raise ValueError("MegatronCausalLM: packed documents and context parallelism are not supported")
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device)[None].expand(B, -1)
        if labels is not None and not return_logits and logits_at is None:
            counted = labels != IGNORE_INDEX
            per_token = self.gpt(input_ids, position_ids, None, labels=labels.masked_fill(~counted, 0))
            loss = per_token.float().masked_fill(~counted, 0.0).sum()
            if loss_reduction == "mean":
                loss = loss / counted.sum().clamp(min=1)
            return CausalLMOutput(logits=None, loss=loss)
        logits = self.gpt(input_ids, position_ids, None)
        if logits_at is not None:
            logits = logits.gather(1, logits_at[..., None].expand(*logits_at.shape, logits.shape[-1]))
        loss = cross_entropy(logits, labels, loss_reduction) if labels is not None else None
        return CausalLMOutput(logits=logits, loss=loss)

    def moe_routers(self) -> list[_RouterView]:
        from megatron.core.transformer.moe.router import TopKRouter

        return [_RouterView(m) for m in self.gpt.modules() if isinstance(m, TopKRouter)]

    def indexers(self) -> list:
        return []

    def set_indexers_trainable(self, trainable: bool) -> None:
        if trainable:
            raise ConfigError("the megatron backend has no DSA indexer to train (mid-training runs on the torch backend)")

    def track_max_logit(self, on: bool = True) -> None:
        """megatron-core's attention does not expose its logits: the metric is not logged on this backend."""

    def attention_logit_max(self) -> None:
        return None


def _set_latent_eps(attention, eps: float) -> None:
    """GLM-5's eps on MLA's two latent norms: a norm module of its own (local spec), or the one fused into
    the up-projection after it (transformer-engine's LayerNormColumnParallelLinear)."""
    for norm, fused in _LATENT_NORMS:
        module = getattr(attention, norm, None)
        if module is None or not hasattr(module, "eps"):
            module = getattr(attention, fused)
        module.eps = eps
