"""orthon weights directories <-> megatron state dicts: the conversion (``convert``) with the checks of
orthon's weights format around it (every tensor present with the config's shape, the sidecar kept)."""
from __future__ import annotations

import torch

from orthon.backends.megatron.convert import MegatronLayout, megatron_to_orthon, orthon_to_megatron
from orthon.pretrain.config import ModelConfig, RuntimeOptions


def _meta_model(config: ModelConfig, runtime: RuntimeOptions | None = None):
    from orthon.pretrain.model import GLMForCausalLM

    with torch.device("meta"):
        return GLMForCausalLM(config, init=False, runtime=runtime)


def load_as_megatron(directory, layout: MegatronLayout = MegatronLayout()) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, megatron's full state dict) of a weights directory (orthon's, or any HF glm_moe_dsa
    checkpoint); missing, extra or mis-shaped tensors are a CheckpointError naming them."""
    from orthon.pretrain import hf_io
    from orthon.pretrain.weights import load_config

    config = load_config(directory)
    state = hf_io.check_state(_meta_model(config), hf_io.load_hf_state(directory))
    return config, orthon_to_megatron(state, config, layout)


def save_from_megatron(state: dict[str, torch.Tensor], config: ModelConfig, directory,
                       layout: MegatronLayout = MegatronLayout(), runtime: RuntimeOptions | None = None,
                       dtype: torch.dtype | None = None):
    """Write megatron's full state dict as an orthon weights directory (HF layout + sidecar), after
    checking every tensor against the config."""
    from orthon.pretrain import hf_io
    from orthon.pretrain.weights import save_weights

    model = _meta_model(config, runtime)
    orthon_state = hf_io.check_state(model, {k: v.detach().cpu() for k, v in megatron_to_orthon(state, config, layout).items()})
    return save_weights(model, directory, orthon_state, dtype=dtype)
