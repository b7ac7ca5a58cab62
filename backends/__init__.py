"""orthon.backends: the one GLM-5 model on other frameworks (MindSpore, megatron-core), each behind its
own extra. The torch model in orthon.pretrain is the reference: a backend builds the same architecture
from the same ModelConfig, reads and writes the same weights format (the HF ``glm_moe_dsa`` layout,
converted where the framework names tensors otherwise) and takes the optimizer routing from the same
``param_specs``."""
