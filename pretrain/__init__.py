"""orthon.pretrain: the GLM-5 model and everything that trains it from scratch."""
from orthon.pretrain.config import ModelConfig, RuntimeOptions
from orthon.pretrain.model import CausalLMOutput, GLMForCausalLM


def save_weights(model, directory, state=None, **kwargs):
    """Write a weights directory: the HF ``glm_moe_dsa`` layout + the orthon.json sidecar
    (``orthon.pretrain.weights.save_weights``)."""
    from orthon.pretrain.weights import save_weights as _save

    return _save(model, directory, state, **kwargs)


def load_weights(directory, device="cpu", dtype=None, **runtime_fields) -> GLMForCausalLM:
    """The model of a weights directory, orthon's or any HF ``glm_moe_dsa`` checkpoint
    (``orthon.pretrain.weights.load_weights``)."""
    from orthon.pretrain.weights import load_weights as _load

    return _load(directory, device=device, dtype=dtype, **runtime_fields)


# The name HF users look for: an HF glm_moe_dsa directory is a weights directory.
from_hf = load_weights

__all__ = ["ModelConfig", "RuntimeOptions", "GLMForCausalLM", "CausalLMOutput", "save_weights", "load_weights", "from_hf"]
