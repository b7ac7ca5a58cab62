"""Sample text from a run's model: the KV-cached decode path with temperature / top-k sampling."""
from __future__ import annotations

from pathlib import Path

import torch

from orthon.pretrain.model import GLMForCausalLM


@torch.inference_mode()
def generate_ids(model: GLMForCausalLM, prompt: list[int], max_new_tokens: int, temperature: float = 1.0,
                 top_k: int = 0, eos_id: int | None = None, seed: int = 0) -> list[int]:
    """Continue one prompt; greedy when temperature is 0."""
    if not prompt:
        raise ValueError("prompt: empty (no token ids to continue)")
    model.eval()
    device = model.lm_head.weight.device
    capacity = min(len(prompt) + max_new_tokens, model.config.max_position_embeddings)
    if len(prompt) >= capacity:
        raise ValueError(f"prompt: {len(prompt)} tokens leave no room under max_position_embeddings "
                         f"({model.config.max_position_embeddings})")
    cache = model.new_cache(1, capacity)
    generator = torch.Generator(device=device).manual_seed(seed)
    ids = torch.tensor([prompt], device=device)
    out: list[int] = []
    for _ in range(capacity - len(prompt)):
        logits = model(ids, cache=cache).logits[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = logits.topk(min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        out.append(nxt)
        if eos_id is not None and nxt == eos_id:
            break
        ids = torch.tensor([[nxt]], device=device)
    return out


def sample_text(run_dir, prompt: str, max_new_tokens: int = 100, temperature: float = 0.8, top_k: int = 40,
                seed: int = 0) -> str:
    from orthon.data.tokenizer import load_tokenizer
    from orthon.pretrain.recipe import load_recipe
    from orthon.pretrain.weights import load_weights

    run_dir = Path(run_dir)
    recipe = load_recipe(run_dir / "config.yaml")
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    model = load_weights(run_dir / "final")
    ids = generate_ids(model, tokenizer.encode(prompt), max_new_tokens, temperature, top_k, tokenizer.eos_id, seed)
    return prompt + tokenizer.decode(ids)
