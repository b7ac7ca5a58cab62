"""orthon weights directories <-> megatron state dicts: the conversion (``convert``) with the checks of
orthon's weights format around it (every tensor present with the config's shape, the sidecar kept)."""
from __future__ import annotations

import torch

from orthon.backends.megatron.convert import MegatronLayout, megatron_to_orthon, orthon_to_megatron
from orthon.pretrain import hf_io
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.model_info import meta_model
from orthon.pretrain.weights import read_checked, save_weights


def load_as_megatron(directory, layout: MegatronLayout = MegatronLayout()) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, megatron's full state dict) of a weights directory (orthon's, or any HF glm_moe_dsa
    checkpoint); missing, extra or mis-shaped tensors are a CheckpointError naming them."""
    model, state = read_checked(directory)
    return model.config, orthon_to_megatron(state, model.config, layout)


def save_from_megatron(state: dict[str, torch.Tensor], config: ModelConfig, directory,
                       layout: MegatronLayout = MegatronLayout(), runtime: RuntimeOptions | None = None,
                       dtype: torch.dtype | None = None):
    """Write megatron's full state dict as an orthon weights directory (HF layout + sidecar), after
    checking every tensor against the config."""
    model = meta_model(config, runtime)
    orthon_state = hf_io.check_state(model, {k: v.detach().cpu() for k, v in megatron_to_orthon(state, config, layout).items()})
    return save_weights(model, directory, orthon_state, dtype=dtype)
