"""orthon's model against transformers' GlmMoeDsaForCausalLM on the same weights, both directions."""
import pytest
import torch

from hf_reference import CASES, hf_model_from_dir, randomize_router_bias, small_config, small_model
from orthon.pretrain import GLMForCausalLM, from_hf
from orthon.pretrain.hf_io import load_hf_state
from orthon.pretrain.weights import save_weights

transformers = pytest.importorskip("transformers")

SEQ = 40  # longer than index_topk (8) in the DSA cases


@pytest.mark.parametrize("case", list(CASES))
def test_orthon_to_hf_logits(case, tmp_path):
    model = GLMForCausalLM(small_config(case)).eval()
    randomize_router_bias(model)
    save_weights(model, tmp_path)
    reference = hf_model_from_dir(tmp_path)
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ))
    with torch.no_grad():
        ours, theirs = model(ids).logits, reference(ids).logits
    assert ours.shape == (2, SEQ, model.config.vocab_size)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("case", ["moe", "indexshare"])
def test_hf_to_orthon_logits_and_round_trip(case, tmp_path):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    hf_dir, back_dir = tmp_path / "hf", tmp_path / "back"
    cfg = small_config(case).to_hf_dict()
    cfg.pop("architectures")
    cfg.pop("model_type")
    torch.manual_seed(1)
    reference = GlmMoeDsaForCausalLM(GlmMoeDsaConfig(**cfg)).eval()
    reference.save_pretrained(hf_dir)
    model = from_hf(hf_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-4, rtol=0)
    save_weights(model, back_dir)
    assert _raw_keys(hf_dir) == _raw_keys(back_dir)  # the same on-disk names (one tensor per expert)
    original, again = load_hf_state(hf_dir), load_hf_state(back_dir)
    assert original.keys() == again.keys()
    for key in original:
        assert torch.equal(original[key], again[key]), key


def _raw_keys(directory):
    from safetensors import safe_open

    keys = set()
    for path in directory.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            keys |= set(f.keys())
    return keys


@pytest.mark.parametrize("impl", ["mask", "gather"])
def test_sparse_impls_match_hf(impl, tmp_path):
    model = small_model("indexshare", sparse_impl=impl, query_chunk=7).eval()
    save_weights(model, tmp_path)
    reference = hf_model_from_dir(tmp_path)
    ids = torch.randint(0, model.config.vocab_size, (2, SEQ))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=1e-4, rtol=0)


def test_indexer_selects_hf_keys_on_untied_rows():
    """With few indexer heads, ReLU makes many scores exactly 0 and rows tie at the top-k boundary;
    there transformers' pick is whatever torch.topk returns. On every untied row, the sets agree."""
    from transformers import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer, GlmMoeDsaRotaryEmbedding

    from orthon.pretrain.attention import index_scores, select_topk
    from orthon.pretrain.layers import rope_cos_sin

    config = small_config("dsa", index_n_heads=4)
    hf_cfg = GlmMoeDsaConfig(**{k: v for k, v in config.to_hf_dict().items() if k not in ("architectures", "model_type")})
    model = GLMForCausalLM(config).eval()
    ours = model.model.layers[0].self_attn.indexer
    theirs = GlmMoeDsaIndexer(hf_cfg, 0).eval()
    theirs.load_state_dict(ours.state_dict())
    rotary = GlmMoeDsaRotaryEmbedding(hf_cfg)
    B, T, k = 4, 48, config.index_topk
    untied = tied = 0
    for trial in range(5):
        x = torch.randn(B, T, config.hidden_size)
        q_resid = torch.randn(B, T, config.q_lora_rank)
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None].expand(B, T, T)
        with torch.no_grad():
            hf_idx = theirs(x, q_resid, rotary(x, pos), mask, pos).long()
            cos, sin = rope_cos_sin(torch.arange(T), config.qk_rope_head_dim, config.rope_theta, x.dtype)
            q, w = ours.queries(x, q_resid, cos, sin)
            scores = index_scores(q, w, ours.keys(x, cos, sin), ours.scale)
            our_idx = select_topk(scores, torch.arange(T), k)
        causal = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        ranked = causal.sort(-1, descending=True).values
        for b in range(B):
            for t in range(k, T):  # rows with more causal keys than k
                if ranked[b, t, k - 1] == ranked[b, t, k]:
                    tied += 1
                    continue
                untied += 1
                assert set(our_idx[b, t].tolist()) == set(hf_idx[b, t].tolist()), (trial, b, t)
    assert untied > 100 and tied > 0  # the test saw both kinds of rows


def test_cli_import_export_round_trip(tmp_path):
    import subprocess
    import sys

    model = GLMForCausalLM(small_config("indexshare"))
    save_weights(model, tmp_path / "hf")
    run = lambda *a: subprocess.run([sys.executable, "-m", "orthon.launch.cli", *map(str, a)], check=True,
                                    capture_output=True, text=True)
    run("import", tmp_path / "hf", "--out", tmp_path / "orthon")
    run("export", tmp_path / "orthon", "--out", tmp_path / "hf2")
    a, b = load_hf_state(tmp_path / "hf"), load_hf_state(tmp_path / "hf2")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert from_hf(tmp_path / "hf2").config == model.config
