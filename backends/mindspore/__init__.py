"""orthon.backends.mindspore: GLM-5 in MindSpore (extra ``mindspore``; CPU here, Ascend 910B on Atlas).

The same architecture as orthon's torch model, built from the same ModelConfig (MLA, the DSA indexer
with its deterministic top-k, IndexShare, MoE), the same weights format, Muon + Muon Split + AdamW
from the same ``param_specs``, and a training loop over the same data pipeline
(``orthon pretrain -c RECIPE backend=mindspore``).

    from orthon.backends.mindspore import from_hf, save_hf
    cell = from_hf("runs/tiny/final")
    logits = cell(mindspore.Tensor(ids, mindspore.int32))    # (batch, seq) -> (batch, seq, vocab)

Importing this package without MindSpore installed raises a ConfigError naming the extra.
"""
from orthon.backends.mindspore.runtime import place
from orthon.backends.mindspore.model import GLMForCausalLM
from orthon.backends.mindspore.weights import build, from_hf, save_hf

__all__ = ["GLMForCausalLM", "place", "build", "from_hf", "save_hf"]
