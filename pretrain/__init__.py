"""orthon.pretrain: the GLM-5 model and everything that trains it from scratch."""
from orthon.pretrain.config import ModelConfig
from orthon.pretrain.model import CausalLMOutput, GLMForCausalLM


def from_hf(directory, device="cpu", dtype=None, **orthon_fields) -> GLMForCausalLM:
    """The model of an HF ``glm_moe_dsa`` directory (config.json + safetensors)."""
    from orthon.pretrain.hf_io import from_hf as _from_hf

    return _from_hf(directory, device=device, dtype=dtype, **orthon_fields)


__all__ = ["ModelConfig", "GLMForCausalLM", "CausalLMOutput", "from_hf"]
