"""KV-cached incremental decoding equals the full forward, including past index_topk."""
import torch

from hf_reference import small_config
from orthon.pretrain import GLMForCausalLM


def _greedy(model, prompt, steps, use_cache):
    ids = prompt
    cache = model.new_cache(prompt.shape[0], prompt.shape[1] + steps) if use_cache else None
    new = prompt
    for _ in range(steps):
        with torch.no_grad():
            logits = model(new if use_cache else ids, cache=cache).logits[:, -1]
        nxt = logits.argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
        new = nxt
    return ids


def test_cached_decoding_equals_full_forward_token_by_token():
    model = GLMForCausalLM(small_config("indexshare")).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 30))
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache(2, 30)
        pieces = [model(ids[:, :5], cache=cache).logits]  # a prefill, then one token at a time
        for t in range(5, 30):
            pieces.append(model(ids[:, t : t + 1], cache=cache).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-4, rtol=0)


def test_greedy_256_tokens_identical_with_and_without_cache():
    model = GLMForCausalLM(small_config("dsa", index_n_heads=4, initializer_range=0.2)).eval()
    prompt = torch.randint(0, model.config.vocab_size, (1, 8))
    with_cache = _greedy(model, prompt, 256, use_cache=True)
    without = _greedy(model, prompt, 256, use_cache=False)
    assert torch.equal(with_cache, without)
    assert len(set(with_cache[0, 8:].tolist())) > 5  # a real continuation, not one token repeated


def test_cache_capacity_error():
    model = GLMForCausalLM(small_config("moe")).eval()
    cache = model.new_cache(1, 4)
    try:
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    except ValueError as exc:
        assert "capacity 4" in str(exc)
    else:
        raise AssertionError("expected a capacity error")


def test_left_padded_batch_decodes_like_each_prompt_alone():
    """Batched generation with prompts of different lengths: pads are document -1, positions shifted."""
    model = GLMForCausalLM(small_config("dsa")).eval()
    prompts = [torch.randint(0, 257, (n,)) for n in (5, 12)]
    width = max(len(p) for p in prompts)
    ids = torch.stack([torch.cat([torch.zeros(width - len(p), dtype=torch.long), p]) for p in prompts])
    pads = torch.tensor([width - len(p) for p in prompts])
    slots = torch.arange(width)
    docs = torch.where(slots[None] < pads[:, None], -1, 0)
    positions = (slots[None] - pads[:, None]).clamp(min=0)
    steps = 20
    cache = model.new_cache(2, width + steps)
    with torch.no_grad():
        logits = model(ids, cache=cache, doc_ids=docs, position_ids=positions).logits[:, -1]
        out = [logits.argmax(-1)]
        for t in range(steps - 1):
            pos = (width + t - pads)[:, None]
            logits = model(out[-1][:, None], cache=cache, position_ids=pos).logits[:, -1]
            out.append(logits.argmax(-1))
    batched = torch.stack(out, dim=1)
    for row, prompt in enumerate(prompts):
        alone = _greedy(model, prompt[None], steps, use_cache=True)[0, len(prompt):]
        assert torch.equal(batched[row], alone), row


def test_a_cache_grows_and_takes_rows_that_end_where_its_own_do():
    """KVCache.grow keeps what is cached; add_rows places a joining batch's entries to end at the cache's
    length, its earlier slots left padding (document -1), and refuses entries that would not end there."""
    import pytest

    model = GLMForCausalLM(small_config("dsa")).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    with torch.no_grad():
        cache = model.new_cache(2, 8)
        model(ids, cache=cache)
        before = [t.clone() for t in cache.latent]
        cache.grow(12)
        assert cache.capacity == 12 and all(torch.equal(t[:, :8], b) for t, b in zip(cache.latent, before))
        other = model.new_cache(1, 4)
        model(ids[:1, :4], cache=other)
        with pytest.raises(ValueError, match="do not end at this cache's 6"):
            cache.add_rows(other, at=1)
        cache.add_rows(other, at=2)
    assert cache.batch_size == 3 and cache.latent[0].shape == (3, 12, cache.latent[0].shape[2])
    assert torch.equal(cache.latent[0][2, 2:6], other.latent[0][0, :4]) and not cache.latent[0][2, :2].any()
    assert cache.docs[2, :6].tolist() == [-1, -1, 0, 0, 0, 0] and cache.docs[:2, :6].eq(0).all()
