"""orthon.pretrain: the GLM-5 model and everything that trains it from scratch."""
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.model import CausalLMOutput, GLMForCausalLM


def from_hf(directory, device="cpu", dtype=None, runtime: RuntimeOptions | None = None) -> GLMForCausalLM:
    """The model of an HF ``glm_moe_dsa`` directory (config.json + safetensors)."""
    from orthon.pretrain.hf_io import from_hf as _from_hf

    return _from_hf(directory, device=device, dtype=dtype, runtime=runtime)


__all__ = ["ModelConfig", "RuntimeOptions", "GLMForCausalLM", "CausalLMOutput", "from_hf"]
