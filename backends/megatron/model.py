"""GLM-5 as a megatron-core GPTModel: MLA + MoE from megatron's layer specs, TP / PP / EP sizes from
``MegatronOptions``, transformer-engine layers where TE is installed (megatron's local layers and torch's
SDPA otherwise), orthon's weights loaded through the conversion of ``convert`` / ``parallel``.

megatron-core allocates its MoE router state on the current CUDA device; without CUDA ``build_model``
points that at the CPU (``compat``), so small models build and train on a laptop. What differs from
orthon's torch model by construction: megatron has one ``layernorm_epsilon`` for every norm, where GLM-5
gives its two latent norms (q_a / kv_a) 1e-6 and the others ``rms_norm_eps`` (1e-5) (the Trainer's model,
``causal_lm``, sets the two back); megatron always
renormalises sigmoid top-k weights (norm_topk_prob must be true) and scores expert groups by their top
(topk / topk_group) experts where GLM-5 takes the top 2 (the same for GLM-5's single group); and the DSA
indexer is not part of this dense-MLA model (pretraining runs dense; its tensors travel with the weights)."""
from __future__ import annotations

import dataclasses
import os

import torch

from orthon.backends.megatron import compat
from orthon.backends.megatron.convert import MegatronLayout
from orthon.backends.megatron.parallel import ParallelSizes, check_parallel, shard
from orthon.core.errors import CheckpointError, ConfigError, OrthonError
from orthon.pretrain.config import ModelConfig
from orthon.pretrain.recipe import MegatronOptions

INSTALL = "pip install orthon[megatron]"


def sizes_of(options: MegatronOptions) -> ParallelSizes:
    return ParallelSizes(options.tensor_parallel, options.pipeline_parallel, options.expert_parallel,
                         options.expert_tensor_parallel)


def stage_sizes(options: MegatronOptions) -> ParallelSizes:
    """The layout ``parallel.shard`` / ``merge`` cut the model by: each model chunk a stage of its own
    (with a virtual pipeline, PP x VP stages of consecutive layers; chunk c of pipeline rank r is stage
    c x PP + r)."""
    return dataclasses.replace(sizes_of(options), pp=options.pipeline_parallel * options.virtual_pipeline_parallel)


def _virtual_size(options: MegatronOptions) -> int | None:
    """megatron's virtual_pipeline_model_parallel_size (None: no virtual pipeline)."""
    return options.virtual_pipeline_parallel if options.virtual_pipeline_parallel > 1 else None


def require_megatron() -> None:
    """megatron-core importable (with TE-less megatron's two flags corrected), else the extra to install."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as exc:
        raise OrthonError(f"the megatron backend needs megatron-core ({exc}); {INSTALL}") from None
    from orthon.backends.megatron import compat

    compat.apply()


def use_te(options: MegatronOptions) -> bool:
    from orthon.backends.megatron.compat import have_transformer_engine

    if options.transformer_engine == "off":
        return False
    have = have_transformer_engine()
    if options.transformer_engine == "on" and not have:
        raise OrthonError("transformer_engine: on, but transformer-engine does not import; pip install orthon[te]")
    return have


def layout(te: bool) -> MegatronLayout:
    """The state-dict names and splits of the model orthon builds with or without TE (TE: fused norms,
    TEGroupedMLP experts; both: MLA's down-projections replicated across TP)."""
    return MegatronLayout(te=te, grouped_experts=te, column_down_proj=False)


def transformer_config(model: ModelConfig, options: MegatronOptions, te: bool = False, recompute: bool = False):
    """megatron-core's MLATransformerConfig for ``model`` (no GPU needed). What megatron cannot compute
    the way GLM-5 does is a ConfigError naming the setting. ``recompute``: each decoder layer recomputed
    in the backward instead of keeping its activations (megatron's full, uniform recompute of one layer at
    a time: orthon's ``runtime.activation_checkpointing``)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    sizes = sizes_of(options)
    check_parallel(model, sizes, layout(te))
    stages = stage_sizes(options).pp
    if model.num_hidden_layers % stages:
        raise ConfigError(f"megatron.pipeline_parallel x megatron.virtual_pipeline_parallel = {stages} does not divide "
                          f"the model's {model.num_hidden_layers} layers (num_hidden_layers)")
    if model.has_moe and not model.norm_topk_prob and model.num_experts_per_tok > 1:
        raise ConfigError("norm_topk_prob: megatron-core renormalises the sigmoid top-k weights; false is not "
                          "supported by the megatron backend")
    if model.has_moe and model.n_group > 1 and model.num_experts_per_tok // model.topk_group != 2:
        raise ConfigError(f"topk_group: megatron scores an expert group by its top num_experts_per_tok / topk_group "
                          f"({model.num_experts_per_tok} / {model.topk_group}) experts, GLM-5 by its top 2")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[options.params_dtype]
    moe = {}
    if model.has_moe:
        moe = dict(
            num_moe_experts=model.n_routed_experts, moe_ffn_hidden_size=model.moe_intermediate_size,
            moe_router_topk=model.num_experts_per_tok, moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True, moe_router_bias_update_rate=options.moe_bias_rate,
            moe_router_topk_scaling_factor=model.routed_scaling_factor, moe_router_dtype="fp32",
            moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
            moe_router_num_groups=model.n_group if model.n_group > 1 else None,
            moe_router_group_topk=model.topk_group if model.n_group > 1 else None,
            moe_shared_expert_intermediate_size=(model.moe_intermediate_size * model.n_shared_experts
                                                 if model.n_shared_experts else None),
            moe_layer_freq=[int(model.is_moe_layer(i)) for i in range(model.num_hidden_layers)],
            moe_token_dispatcher_type=options.token_dispatcher, moe_grouped_gemm=te,
        )
    return MLATransformerConfig(
        num_layers=model.num_hidden_layers, hidden_size=model.hidden_size, ffn_hidden_size=model.intermediate_size,
        num_attention_heads=model.num_attention_heads, q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank,
        qk_head_dim=model.qk_nope_head_dim, qk_pos_emb_head_dim=model.qk_rope_head_dim, v_head_dim=model.v_head_dim,
        rope_type="rope", rotary_base=model.rope_theta, rotary_scaling_factor=1.0, normalization="RMSNorm",
        layernorm_epsilon=model.rms_norm_eps, qk_layernorm=True, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=model.initializer_range,
        tensor_model_parallel_size=sizes.tp, pipeline_model_parallel_size=sizes.pp,
        virtual_pipeline_model_parallel_size=_virtual_size(options),
        expert_model_parallel_size=sizes.ep, expert_tensor_parallel_size=sizes.expert_tp,
        sequence_parallel=sizes.tp > 1, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        pipeline_dtype=dtype if sizes.pp > 1 else None,
        use_cpu_initialization=not torch.cuda.is_available(), **moe,
        **(dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) if recompute else {}),
    )


def block_spec(config, te: bool, vp_stage: int | None = None):
    """The decoder's layer specs: megatron's MLA layers with the dense / MoE pattern of ``moe_layer_freq``;
    without TE, MLA's core attention is orthon's SDPA module (see core_attention), its down-projections
    replicated and its norms sequence-parallel (see local_spec)."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    from orthon.backends.megatron.core_attention import SDPACoreAttention
    from orthon.backends.megatron.local_spec import replace_torch_norms, use_replicated_down_projections

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm", vp_stage=vp_stage)
    if not te:
        spec.layer_specs = [copy.deepcopy(s) for s in spec.layer_specs]  # the specs are shared objects
        for layer in spec.layer_specs:
            layer.submodules.self_attention.submodules.core_attention = SDPACoreAttention
            use_replicated_down_projections(layer)
        replace_torch_norms(spec)
    return spec


def initialize_parallel(options: MegatronOptions) -> None:
    """torch.distributed (NCCL, gloo without CUDA; one process when not under a launcher) and megatron's
    parallel groups."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "MASTER_ADDR" in os.environ:  # a launcher's rendezvous
            dist.init_process_group(backend)
        else:  # one process: megatron's groups of one, through an in-process store (no port to collide on)
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        sizes = sizes_of(options)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=sizes.tp, pipeline_model_parallel_size=sizes.pp,
            virtual_pipeline_model_parallel_size=_virtual_size(options),
            expert_model_parallel_size=sizes.ep, expert_tensor_parallel_size=sizes.expert_tp)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(options.seed)


def build_model(model: ModelConfig, options: MegatronOptions | None = None, recompute: bool = False):
    """The megatron-core GPTModel of this rank (its pipeline stage, its TP / EP shard); initialises
    torch.distributed and megatron's groups unless they are. Without CUDA it is built for the CPU
    (``compat.point_cuda_device_at_cpu``, ``compat.use_cpu_rng_tracker``; the MoE tokens through
    megatron's allgather dispatcher, since its alltoall one needs CUDA streams): small models train on a
    laptop, tensor parallel too (sequence-parallel norms: ``local_spec``). ``recompute``: see
    ``transformer_config``. With a virtual pipeline a rank holds several models: ``build_chunks``."""
    chunks = build_chunks(model, options, recompute)
    if len(chunks) > 1:
        raise ConfigError("megatron.virtual_pipeline_parallel > 1: a rank holds several model chunks (build_chunks)")
    return chunks[0]


def build_chunks(model: ModelConfig, options: MegatronOptions | None = None, recompute: bool = False) -> list:
    """This rank's model chunks (``build_model``): one GPTModel, or with a virtual pipeline
    (``virtual_pipeline_parallel``) one per chunk, chunk c holding stage c x PP + rank's layers."""
    options = options or MegatronOptions()
    require_megatron()
    if compat.point_cuda_device_at_cpu():
        compat.use_cpu_rng_tracker()
        options = dataclasses.replace(options, token_dispatcher="allgather")
    return _build(model, options, recompute)


def _build(model: ModelConfig, options: MegatronOptions, recompute: bool = False) -> list:
    require_megatron()
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    te = use_te(options)
    config = transformer_config(model, options, te, recompute)
    initialize_parallel(options)
    chunks = []
    virtual = options.virtual_pipeline_parallel > 1
    for chunk in range(options.virtual_pipeline_parallel):
        vp_stage = chunk if virtual else None
        gpt = GPTModel(
            config, block_spec(config, te, vp_stage), vocab_size=model.vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=not virtual, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=not virtual, vp_stage=vp_stage),
            share_embeddings_and_output_weights=model.tie_word_embeddings, position_embedding_type="rope",
            rotary_base=int(model.rope_theta), vp_stage=vp_stage)
        gpt.orthon_layout = layout(te)  # the names its state dict has, for the conversion
        chunks.append(gpt)
    return chunks


def rank_key(chunk: int = 0) -> tuple[int, int, int]:
    """(stage, tp, ep) of this process's model chunk ``chunk``: which shard of ``parallel.shard`` (cut by
    ``stage_sizes``) it holds."""
    from megatron.core import parallel_state

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    return (chunk * pp + parallel_state.get_pipeline_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank())


def load_megatron_state(gpt, full_state: dict[str, torch.Tensor], model: ModelConfig, options: MegatronOptions,
                        chunk: int = 0) -> None:
    """Load this rank's shard of megatron's full state dict (``convert.hf_to_megatron`` /
    ``weights.load_as_megatron``) into ``gpt`` (its model chunk ``chunk``); a parameter the shard does not
    give is a CheckpointError."""
    key = rank_key(chunk)
    mine = shard(full_state, model, stage_sizes(options), gpt.orthon_layout, only=key)[key]
    expected = {k for k in gpt.state_dict() if not k.endswith("._extra_state")}
    missing = sorted(expected - set(mine))
    if missing:
        raise CheckpointError(f"the converted weights lack {len(missing)} tensors of the megatron model: {missing[:6]}")
    with torch.no_grad():
        params = dict(gpt.state_dict(keep_vars=True))
        for name in expected:
            params[name].copy_(mine[name].to(params[name].dtype))
