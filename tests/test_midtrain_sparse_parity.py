"""Sparse attention at mid-training lengths: gathering the top-k latents per query (absorbed MQA form,
query chunks) equals dense attention with a top-k mask on the same indices, and both equal
transformers' GlmMoeDsaForCausalLM."""
import pytest
import torch

from hf_reference import hf_model_from_dir, small_model
from orthon.pretrain.weights import save_weights
from orthon.pretrain.attention import attention_mask
from orthon.pretrain.layers import rope_cos_sin

T = 520  # many times index_topk, several query chunks


pytestmark = pytest.mark.usefixtures("one_thread")


def test_gathered_topk_equals_masked_dense_on_the_same_indices():
    model = small_model("dsa", index_topk=32, index_n_heads=16, query_chunk=96, initializer_range=0.1)
    config = model.config
    attn = model.model.layers[0].self_attn.eval()
    x = torch.randn(2, T, config.hidden_size)
    cos, sin = rope_cos_sin(torch.arange(T), config.qk_rope_head_dim, config.rope_theta, x.dtype)
    slots = torch.arange(T)
    with torch.no_grad():
        q_resid, q_nope, q_rope, latent = attn.project(x, cos, sin)
        topk, _ = attn._select(x, q_resid, cos, sin, attn.indexer.keys(x, cos, sin), slots, None, False)
        gathered = attn._absorbed(q_nope, q_rope, latent, slots, topk)
        masked = attn._expanded(q_nope, q_rope, latent, attention_mask(topk, slots, T))
    assert topk.shape == (2, T, 32)
    # float32 round-off only (both softmaxes run in fp32 over the same selected keys)
    torch.testing.assert_close(gathered, masked, rtol=1e-5, atol=1e-6)
    assert (gathered - masked).abs().max() < 1e-4 * masked.abs().max()


@pytest.mark.parametrize("impl", ["gather", "mask"])
def test_sparse_model_matches_transformers_at_length(impl, tmp_path):
    pytest.importorskip("transformers")
    model = small_model("indexshare", index_topk=48, sparse_impl=impl, query_chunk=128).eval()
    config = model.config
    save_weights(model, tmp_path)
    reference = hf_model_from_dir(tmp_path)
    ids = torch.randint(0, config.vocab_size, (1, T))
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
