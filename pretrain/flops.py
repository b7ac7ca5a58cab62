"""Model FLOPs of training on sequences, for the step metrics' TFLOP/s and MFU.

The count is the field's usual one (PaLM's appendix B, Megatron-LM, torchtitan), so that an MFU reads
against published ones: a multiply-add is 2 FLOPs, the backward does twice the forward's products
(gradients of the inputs and of the weights), and only the model's mathematics counts, not how a
kernel computes it (no recomputation: activation checkpointing, flash attention's backward; no savings:
a causal query is charged for all n keys of its sequence, as in those formulas). A token costs

- 6 per active matrix parameter: attention's projections, the dense MLPs, the routers, the routed experts
  a token goes to (top-k of them), the shared experts and the output head; not the embedding (a lookup)
  or the norms;
- 6 H (qk_head_dim + v_head_dim) per key and layer: MLA's scores and weighted values in its per-head form
  (the absorbed form computes the same products another way), over the n keys of its sequence, or the
  index_topk selected ones where DSA's sparse attention selects (n > index_topk);
- where DSA selects or mid-training fits the indexer, each layer with its own indexer (IndexShare's
  shared layers reuse one): its three projections and its scores, 2 n_idx d_idx per key over all n
  keys, forward only when it just selects, with its backward (3x) where mid-training fits it.
"""
from __future__ import annotations

from dataclasses import dataclass

from orthon.pretrain.config import ModelConfig

MATMUL_COMPONENTS = ("attention", "dense_mlp", "router", "routed_experts", "shared_experts", "output_head")


@dataclass(frozen=True)
class ModelFlops:
    """The numbers of a ModelConfig the count needs (``of``), and the count itself."""

    matmul_parameters: int  # active per token
    layers: int
    attention_per_key: int  # 2 H (qk_head_dim + v_head_dim): one layer's forward FLOPs per key
    index_topk: int
    indexer_layers: int  # layers with their own indexer
    indexer_parameters: int
    indexer_per_key: int  # 2 n_idx d_idx

    @classmethod
    def of(cls, config: ModelConfig) -> ModelFlops:
        from orthon.pretrain.model_info import parameter_counts  # builds the model on the meta device

        counts, c = parameter_counts(config), config
        return cls(
            matmul_parameters=sum(counts[k]["active"] for k in MATMUL_COMPONENTS if k in counts),
            layers=c.num_hidden_layers,
            attention_per_key=2 * c.num_attention_heads * (c.qk_head_dim + c.v_head_dim),
            index_topk=c.index_topk,
            indexer_layers=sum(c.indexer_type(i) == "full" for i in range(c.num_hidden_layers)),
            # wq_b (from the query's low-rank code), wk and weights_proj (from the hidden state)
            indexer_parameters=c.index_n_heads * c.index_head_dim * c.q_lora_rank
            + c.hidden_size * (c.index_head_dim + c.index_n_heads),
            indexer_per_key=2 * c.index_n_heads * c.index_head_dim,
        )

    def per_token(self, n: int, sparse: bool = False, indexer_trains: bool = False) -> int:
        """Training FLOPs (forward and backward) of one token of an n-token sequence."""
        selects = sparse and n > self.index_topk  # else every causal key is attended: no selection
        keys = self.index_topk if selects else n
        flops = 3 * (2 * self.matmul_parameters + self.layers * self.attention_per_key * keys)
        if selects or (sparse and indexer_trains):
            indexer = self.indexer_layers * (2 * self.indexer_parameters + self.indexer_per_key * n)
            flops += (3 if indexer_trains else 1) * indexer
        return flops

    def sequences(self, lengths, sparse: bool = False, indexer_trains: bool = False) -> int:
        """Training FLOPs of sequences of these lengths."""
        return sum(n * self.per_token(n, sparse, indexer_trains) for n in lengths)
