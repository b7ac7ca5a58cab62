"""OpenAI's API on `orthon serve`, driven by the official `openai` client: completions and chat completions
equal to the in-process engine on the same weights (greedy text, seeded choices, log-probs, stop
strings, the chat format's rendering and its reasoning block), streams whose pieces add up to the whole
answer, and what the engine does not compute refused by name."""
import shutil

import pytest
import torch

from orthon.engine.in_process import InProcessEngine
from orthon.engine.openai_api import parse_chat, parse_completion, split_reasoning
from orthon.engine.stop_strings import settled_text
from orthon.engine.sampling import SamplingParams
from orthon.engine.sglang_api import BadRequest
from orthon.pretrain.weights import load_weights
from orthon.rl.chat import ChatTemplate
from server_support import ServerProcess, tiny_weights
from test_data_support import hf_tokenizer_json

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = tmp_path_factory.mktemp("openai") / "tiny-model"
    tiny_weights(directory)
    hf_tokenizer_json(directory / "tokenizer.json")
    return directory


@pytest.fixture(scope="module")
def client(served, tmp_path_factory):
    process = ServerProcess(served, tmp_path_factory.mktemp("logs") / "server.log").wait()
    yield openai.OpenAI(base_url=process.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    process.stop()


@pytest.fixture(scope="module")
def reference(served):
    """The in-process engine on the same weights and tokenizer: what the server must answer."""
    from orthon.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(served / "tokenizer.json")
    return InProcessEngine(load_weights(served).eval(), tokenizer=tokenizer), tokenizer


def _text(result, tokenizer):
    if result.matched_stop is not None:
        text = tokenizer.decode(result.tokens)
        return text[:text.index(result.matched_stop)]
    return tokenizer.decode(result.tokens[:-1] if result.finish_reason == "stop" else result.tokens)


def test_completions_equal_the_in_process_engine(client, reference):
    engine, tokenizer = reference
    assert [m.id for m in client.models.list().data] == ["tiny-model"]
    prompt = "def f(x): return x"
    ref = engine.generate([tokenizer.encode(prompt)], SamplingParams(max_new_tokens=12, temperature=0.0))[0]
    got = client.completions.create(model="tiny-model", prompt=prompt, max_tokens=12, temperature=0, logprobs=0)
    choice = got.choices[0]
    assert choice.text == _text(ref, tokenizer) and choice.finish_reason == "length"
    torch.testing.assert_close(torch.tensor(choice.logprobs.token_logprobs), ref.log_probs, atol=1e-5, rtol=0)
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (len(ref.prompt), 12)
    # n seeded choices over two prompts (one as token ids): choice i draws from seed + i, as the engine's.
    ids = tokenizer.encode("hello world")
    sampled = client.completions.create(model="x", prompt=[prompt, ids], max_tokens=6, n=2, seed=40, top_p=0.9)
    params = [SamplingParams(max_new_tokens=6, top_p=0.9, seed=40 + i) for i in range(4)]
    refs = engine.generate([tokenizer.encode(prompt)] * 2 + [ids] * 2, params)
    assert [c.text for c in sampled.choices] == [_text(r, tokenizer) for r in refs]
    assert [c.index for c in sampled.choices] == [0, 1, 2, 3]
    # Each prompt counted once. The first ran before and is held in the prefix cache; the second is new
    # (its n = 2 samples prefilled once), and the batch runs its tokens on both rows (too few to be
    # worth a batch of their own): the first takes the tokens before them from the cache.
    assert sampled.usage.prompt_tokens == len(ref.prompt) + len(ids)
    assert sampled.usage.prompt_tokens_details.cached_tokens == len(ref.prompt) - len(ids)
    # A stop string ends the text before it.
    stop = _text(ref, tokenizer)[5:7]
    stopped = client.completions.create(model="x", prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    full = _text(ref, tokenizer)
    assert stopped.choices[0].text == full[:full.index(stop)] and stopped.choices[0].finish_reason == "stop"


def test_a_stream_adds_up_to_the_whole_answer(client):
    kwargs = dict(model="x", prompt="class A:", max_tokens=120, temperature=0)  # long enough to come in pieces
    whole = client.completions.create(**kwargs).choices[0]
    pieces = list(client.completions.create(stream=True, **kwargs))
    assert "".join(p.choices[0].text for p in pieces) == whole.text
    assert [p.choices[0].finish_reason for p in pieces][-1] == whole.finish_reason
    assert all(p.choices[0].finish_reason is None for p in pieces[:-1]) and len(pieces) > 2


def test_chat_renders_the_conversation_in_the_chat_format(client, reference):
    engine, tokenizer = reference
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    chat = ChatTemplate()
    prompt = tokenizer.encode(chat.render([("system", "Be brief."), ("user", "2+2?")]))
    ref = engine.generate([prompt], SamplingParams(max_new_tokens=10, temperature=0.0, stop=chat.stop))[0]
    reasoning, content = split_reasoning(_text(ref, tokenizer), chat.think)
    got = client.chat.completions.create(model="x", messages=messages, max_tokens=10, temperature=0, logprobs=True)
    message = got.choices[0].message
    assert (message.role, message.content) == ("assistant", content)
    assert getattr(message, "reasoning_content", None) == (reasoning or None)
    torch.testing.assert_close(torch.tensor([t.logprob for t in got.choices[0].logprobs.content]), ref.log_probs,
                               atol=1e-5, rtol=0)
    assert got.usage.prompt_tokens == len(prompt)
    pieces = list(client.chat.completions.create(model="x", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == content


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt="a", echo=True), "echo: not supported"),
    (dict(prompt="a", logprobs=2), "logprobs: only 0"),
    (dict(prompt="a", best_of=3), "best_of: not supported"),
    (dict(prompt="a", frequency_penalty=0.5), "frequency_penalty: not supported"),
    (dict(prompt="a", max_tokens=0), "max_tokens: expected an integer >= 1"),
    (dict(prompt="a", stop=["1", "2", "3", "4", "5"]), "stop: expected a string or up to 4"),
    (dict(prompt=[5, 999]), "prompt 0: token id 999 is outside the vocabulary"),
])
def test_what_the_engine_does_not_compute_is_refused_by_name(client, kwargs, message):
    with pytest.raises(openai.BadRequestError, match=message):
        client.completions.create(model="x", **kwargs)


def test_request_parsing_and_the_stream_helpers():
    chat = ChatTemplate()
    request = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "hi"}]},
                                       {"role": "tool", "content": "42"}], "stop": "##"}, chat, "m", 99)
    assert request.prompts == [chat.render([("system", "hi"), ("observation", "42")])]
    assert request.params.stop == ("##",) + chat.stop and request.params.max_new_tokens == 99
    with pytest.raises(BadRequest, match=r"messages\[0\].role: expected one of"):
        parse_chat({"messages": [{"role": "robot", "content": "x"}]}, chat, "m", 9)
    with pytest.raises(BadRequest, match="tools: not supported"):
        parse_chat({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, chat, "m", 9)
    with pytest.raises(BadRequest, match="colour: unknown parameter"):
        parse_completion({"prompt": "a", "colour": 1}, "m")
    assert parse_completion({"prompt": "a"}, "m").params.max_new_tokens == 16  # OpenAI's default
    assert parse_completion({"prompt": [3, 4], "logprobs": 0}, "m").logprobs and not parse_completion({"prompt": "a"}, "m").logprobs
    with pytest.raises(BadRequest, match="logprobs: only 0"):
        parse_completion({"prompt": "a", "logprobs": False}, "m")
    # A growing text is split the same way whole or in part, so a stream never takes text back.
    think = ("<think>", "</think>")
    assert split_reasoning("<thi", think) == ("", "") and split_reasoning("<think>ab", think) == ("ab", "")
    assert split_reasoning("<think>ab</think>cd", think) == ("ab", "cd") and split_reasoning("xy", think) == ("", "xy")
    assert settled_text("abc\ufffd", ()) == "abc" and settled_text("hello", ("llo!",)) == "he"
