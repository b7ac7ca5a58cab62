"""orthon.backends.megatron: GLM-5 on megatron-core (extra ``megatron``; on CUDA GPUs, or small on the CPU).

The weight conversion is pure tensor code and runs anywhere: ``hf_to_megatron`` / ``megatron_to_hf``
(orthon's weights format <-> megatron-core GPTModel names), ``shard`` / ``merge`` (TP / PP / EP shards),
``load_as_megatron`` / ``save_from_megatron`` (weights directories). ``build_model`` builds the
megatron-core model (MLA and MoE layer specs, transformer-engine layers where installed) and
``build_optimizer`` orthon's Muon + Split for it (``orthon.backends.megatron.model``); ``causal_lm`` is the
model the one Trainer drives with ``backend: megatron`` (data, tensor and expert parallel)."""
from orthon.backends.megatron.convert import (
    MegatronLayout,
    hf_to_megatron,
    megatron_to_hf,
    megatron_to_orthon,
    orthon_to_megatron,
)
from orthon.backends.megatron.parallel import ParallelSizes, check_parallel, merge, shard
from orthon.backends.megatron.weights import load_as_megatron, save_from_megatron

__all__ = ["MegatronLayout", "ParallelSizes", "hf_to_megatron", "megatron_to_hf", "orthon_to_megatron",
           "megatron_to_orthon", "shard", "merge", "check_parallel", "load_as_megatron", "save_from_megatron"]
