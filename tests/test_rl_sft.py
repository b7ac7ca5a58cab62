"""SFT: the loss covers exactly the assistant's tokens (bodies, thinking, the token that ends each of
its turns), its gradient is the hand-computed masked NLL's, and a short run learns the demonstrations."""
from types import SimpleNamespace

import pytest
import torch

from orthon.core.config import build
from orthon.core.errors import DataError
from orthon.data.tokenizer import load_tokenizer
from orthon.pretrain import GLMForCausalLM, ModelConfig
from orthon.pretrain.logprobs import sequence_log_probs
from orthon.pretrain.weights import save_weights
from orthon.rl.chat import Message
from orthon.rl.recipe import RLRecipe
from orthon.rl.sft import SFTStep, conversation_example, fit_sft
from orthon.rl.tool_tasks import tool_demonstration, tool_demonstrations
from pretrain_support import MODEL

pytestmark = pytest.mark.usefixtures("one_thread")


def test_loss_mask_covers_the_assistants_tokens_only(chat_tokenizer):
    tok = chat_tokenizer
    example = conversation_example(tool_demonstration("Q: 123*456=? A:", "56088"), tok)
    trained = [t for t, m in zip(example.tokens[example.prompt_length:], example.loss_mask) if m]
    assert tok.decode(trained) == ("<think></think>```python tool_name=calculator\nprint(123*456)\n```<|observation|>"
                                   "<think></think>56088<|user|>")
    # Untrained: the user turn and role headers, and the observation's body.
    assert tok.decode(example.tokens[: example.prompt_length]) == "<|user|>\nQ: 123*456=? A:<|assistant|>\n"
    untrained = [t for t, m in zip(example.tokens[example.prompt_length:], example.loss_mask) if not m]
    assert tok.decode(untrained) == "\n56088<|assistant|>\n"
    with pytest.raises(DataError, match="no assistant turn"):
        conversation_example([Message("user", "hi")], tok)


def test_tokenizer_without_chat_tokens_is_refused(tmp_path):
    from test_data_support import train_tiny_tokenizer

    tok = load_tokenizer(train_tiny_tokenizer(tmp_path, vocab_size=512))
    with pytest.raises(DataError, match="chat tokens"):
        conversation_example(tool_demonstration("Q: 1*2=? A:", "2"), tok)


def test_gradient_is_the_masked_nll(chat_tokenizer):
    tok = chat_tokenizer
    torch.manual_seed(0)
    model = GLMForCausalLM(ModelConfig(**{**MODEL, "vocab_size": tok.vocab_size}))
    batch = [conversation_example(c, tok) for c in tool_demonstrations(tok, 3, seed=1)]

    class FakeTrainer:
        device, world, rank, data_world, data_rank = torch.device("cpu"), 1, 0, 1, 0
        cfg = SimpleNamespace(micro_batch_size=2)

    step = SFTStep()
    step.begin(FakeTrainer(), batch)
    model.zero_grad()
    total = 0.0
    micros = step.micro_batches(batch, 2, "cpu")
    assert sorted(map(len, micros)) == [1, 2]  # at most train.micro_batch_size conversations each
    for micro in micros:
        loss, sums = step.loss(model, micro)
        loss.backward()
        total += float(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    out = sequence_log_probs(model, [e.tokens for e in batch], [e.response_length for e in batch])
    mask = torch.zeros_like(out.log_probs)
    for b, e in enumerate(batch):
        mask[b, : e.response_length] = torch.tensor(e.loss_mask, dtype=torch.float32)
    hand = -(out.log_probs * mask).sum() / mask.sum()
    hand.backward()
    assert total == pytest.approx(float(hand.detach()), rel=1e-5)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)


def test_short_sft_run_learns_the_demonstrations(tmp_path, chat_tokenizer, capsys):
    tok = chat_tokenizer
    torch.manual_seed(0)
    save_weights(GLMForCausalLM(ModelConfig(**{**MODEL, "vocab_size": tok.vocab_size})), tmp_path / "init")
    recipe = build(RLRecipe, {"train": {"run_dir": str(tmp_path / "sft"), "progress": True, "micro_batch_size": 8,
                                        "init_from": str(tmp_path / "init"), "checkpoint_interval": 10},
                              "schedule": {"peak_lr": 3e-3, "floor_lr": 3e-3},
                              "sft": {"steps": 20, "batch_size": 8}})
    recipe.model = ModelConfig(**{**MODEL, "vocab_size": tok.vocab_size})
    result = fit_sft(recipe, tok, tool_demonstrations(tok, 32, seed=2), log=lambda *a: None)
    assert result["steps"] == 20 and result["loss_end"] < 0.6 * result["loss_start"]
    err = capsys.readouterr().err  # the progress bar, over optimizer steps
    assert "sft: 100%" in err and "20/20" in err
    assert (tmp_path / "sft" / "final" / "config.json").is_file() and (tmp_path / "sft" / "loss.png").is_file()
