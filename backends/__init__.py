"""orthon.backends: the one GLM-5 model on other frameworks (megatron-core, MindSpore), each with its
weight conversion to and from orthon's weights format (the HF ``glm_moe_dsa`` layout)."""
