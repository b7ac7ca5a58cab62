"""SGLang's worker API as orthon reads and writes it (orthon.engine.sglang_api): sampling parameters both
ways (stop tokens keep orthon's meaning on either kind of server), /generate bodies and their errors,
answers and their parsing back into GenerationResults (SGLang's own shape too), and a garbage answer."""
import pytest
import torch

from orthon.engine.protocol import GenerationResult
from orthon.engine.sampling import SamplingParams
from orthon.engine.sglang_api import (BadRequest, answer, error_message, finish_reason, parse_generate,
                                      parse_weight_version, result_from_answer, sampling_from_sglang,
                                      sampling_to_sglang)

EOS = 1


@pytest.mark.parametrize("params", [
    SamplingParams(),
    SamplingParams(max_new_tokens=7, temperature=0.0, stop_token_ids=()),
    SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=(5, 9), seed=42),
    SamplingParams(temperature=1.3, logprob_mode="sampling", stop_token_ids=(EOS,)),
    SamplingParams(max_new_tokens=9, stop=("</tool_call>", "\n\n")),
])
def test_sampling_params_survive_the_round_trip(params):
    assert sampling_from_sglang(sampling_to_sglang(params), EOS) == params


def test_sglang_stop_tokens_add_the_eos_unless_ignored():
    # SGLang stops at the eos besides the listed ids; orthon's params list every stop token.
    assert sampling_from_sglang({"stop_token_ids": [5]}, EOS).stop_token_ids == (5, EOS)
    assert sampling_from_sglang({"stop_token_ids": [5], "ignore_eos": True}, EOS).stop_token_ids == (5,)
    assert sampling_from_sglang({"ignore_eos": True}, EOS).stop_token_ids == ()
    assert sampling_from_sglang({}, EOS).stop_token_ids is None  # the engine's default: the eos
    wire = sampling_to_sglang(SamplingParams(stop_token_ids=()))
    assert wire["stop_token_ids"] == [] and wire["ignore_eos"] is True
    assert "stop_token_ids" not in sampling_to_sglang(SamplingParams())


def test_sglang_defaults_and_top_k_off():
    p = sampling_from_sglang({"top_k": -1, "sampling_seed": 3}, EOS)
    assert (p.max_new_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (128, 1.0, 1.0, 0, 3)
    assert sampling_to_sglang(SamplingParams(top_k=0))["top_k"] == -1
    # Keys that only shape text, and unsupported ones at their neutral values, are accepted.
    sampling_from_sglang({"skip_special_tokens": False, "min_p": 0.0, "n": 1, "stop": [], "repetition_penalty": 1.0}, EOS)


@pytest.mark.parametrize("sampling,match", [
    ({"max_new_tokens": -1}, "max_new_tokens: must be an int >= 0"),
    ({"temperature": "hot"}, "temperature: expected a number"),
    ({"top_p": 0.0}, "top_p: must be in"),
    ({"min_p": 0.1}, "min_p: not supported"),
    ({"stop": ["\n", ""]}, "stop: expected a string or a list of non-empty strings"),
    ({"stop": 5}, "stop: expected a string or a list"),
    ({"no_stop_trim": 1}, "no_stop_trim: expected true or false"),
    ({"best_of": 2}, "best_of: unknown sampling parameter"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids: expected a list of token ids"),
    ({"ignore_eos": "yes"}, "ignore_eos: expected true or false"),
    ([1, 2], "expected an object"),
])
def test_bad_sampling_params_name_the_key(sampling, match):
    with pytest.raises(BadRequest, match=match) as err:
        sampling_from_sglang(sampling, EOS)
    assert err.value.status == 400


def test_stop_strings_as_sglang_takes_them():
    # One string or a list; "" / [] are none; the text keeps the string only with no_stop_trim.
    assert sampling_from_sglang({"stop": "</s>"}, EOS).stop == ("</s>",)
    assert sampling_from_sglang({"stop": ["a", "bc"]}, EOS).stop == ("a", "bc")
    assert sampling_from_sglang({"stop": ""}, EOS).stop == () == sampling_from_sglang({"stop": []}, EOS).stop
    assert sampling_to_sglang(SamplingParams(stop=("x",)))["stop"] == ["x"]
    assert "stop" not in sampling_to_sglang(SamplingParams())
    trimmed, kept = (parse_generate({"input_ids": [3], "sampling_params": {"stop": "</a>", "no_stop_trim": keep}}, EOS)[0][0]
                     for keep in (False, True))
    result = GenerationResult([3], [7, 8, 9], torch.tensor([-0.5, -1.0, -2.0]), "stop", 2, matched_stop="</a>")
    short, full = answer(result, trimmed, "x = 1</a> and"), answer(result, kept, "x = 1</a> and")
    assert (short["text"], full["text"]) == ("x = 1", "x = 1</a> and")
    assert short["output_ids"] == [7, 8, 9]  # every token generated, the one completing the string too
    assert finish_reason(result) == {"type": "stop", "matched": "</a>"}
    # The client reads the string back; a stop token stays an id.
    logprobs = parse_generate({"input_ids": [3], "return_logprob": True}, EOS)[0][0]
    back = result_from_answer(answer(result, logprobs, ""), [3], SamplingParams(), 0)
    assert (back.finish_reason, back.matched_stop, back.tokens) == ("stop", "</a>", [7, 8, 9])
    by_token = GenerationResult([3], [7, EOS], torch.tensor([-0.5, -1.0]), "stop", 2)
    assert finish_reason(by_token) == {"type": "stop", "matched": EOS}
    assert result_from_answer(answer(by_token, logprobs, "y"), [3], SamplingParams(), 0).matched_stop is None


def test_streams_are_asked_for_one_request_at_a_time():
    from orthon.engine.sglang_api import partial_answer, wants_stream

    assert wants_stream({"stream": True}, batched=False) and not wants_stream({}, batched=True)
    with pytest.raises(BadRequest, match="stream: one request at a time"):
        wants_stream({"stream": True}, batched=True)
    with pytest.raises(BadRequest, match="stream: expected true or false"):
        wants_stream({"stream": "yes"}, batched=False)
    item = parse_generate({"input_ids": [3, 4], "rid": "r"}, EOS)[0][0]
    assert partial_answer(item, [3, 4], [9, 8], "ab", 5) == {"text": "ab", "output_ids": [9, 8], "meta_info": {
        "id": "r", "finish_reason": None, "prompt_tokens": 2, "completion_tokens": 2, "cached_tokens": 0,
        "weight_version": "5"}}


def test_parse_generate_single_batch_and_text():
    items, batched = parse_generate({"input_ids": [3, 4], "rid": "a", "return_logprob": True,
                                     "sampling_params": {"max_new_tokens": 2}}, EOS)
    assert not batched and len(items) == 1
    assert (items[0].prompt, items[0].rid, items[0].return_logprob, items[0].params.max_new_tokens) == ([3, 4], "a", True, 2)
    items, batched = parse_generate({"input_ids": [[3], [4, 5]], "rid": ["x", "y"],
                                     "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2}]}, EOS)
    assert batched and [i.prompt for i in items] == [[3], [4, 5]] and [i.rid for i in items] == ["x", "y"]
    assert [i.params.max_new_tokens for i in items] == [1, 2]
    items, _ = parse_generate({"input_ids": [[3], [4]], "rid": "r", "return_logprob": [True, False]}, EOS)
    assert [i.rid for i in items] == ["r-0", "r-1"]  # one rid for a batch: still one per request
    # Log-probs nobody asked for are not rescored (SGLang's default is return_logprob false).
    assert [i.params.logprob_mode for i in items] == ["policy", "none"]
    items, batched = parse_generate({"text": ["hi", "yo"]}, EOS)
    assert batched and [i.text for i in items] == ["hi", "yo"] and items[0].prompt is None
    # Keys sglang-router adds when it forwards a request, and orthon's routing_key, are accepted.
    items, _ = parse_generate({"input_ids": [1], "model": None, "stream": False, "return_text_in_logprobs": False,
                               "routing_key": "session-3"}, EOS)
    assert items[0].prompt == [1]


@pytest.mark.parametrize("body,match", [
    ({}, "missing input_ids"),
    ({"sampling_params": {}}, "missing input_ids"),
    ({"input_ids": []}, "non-empty list"),
    ({"input_ids": [1, "2"]}, r"input_ids: expected a non-empty list of token ids"),
    ({"input_ids": [[1], [True]]}, r"input_ids\[1\]"),
    ({"input_ids": [1], "text": "a"}, "not both"),
    ({"input_ids": [[1], [2]], "rid": ["a"]}, "rid: 1 values for 2 requests"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1], "rid": 5}, "rid: expected a string"),
    ({"text": 5}, "text: expected a string"),
    ([1, 2], "expected a JSON object"),
])
def test_bad_generate_bodies_name_what_is_wrong(body, match):
    with pytest.raises(BadRequest, match=match):
        parse_generate(body, EOS)


def test_weight_versions_as_sglang_sends_them():
    assert parse_weight_version(None) is None
    assert parse_weight_version("12") == 12 and parse_weight_version(3) == 3
    for bad in ("v2", -1, 1.5, True, "default"):
        with pytest.raises(BadRequest, match="weight_version"):
            parse_weight_version(bad)


def _result(reason, tokens=(4, 9), error=None):
    return GenerationResult(prompt=[1, 2, 3], tokens=list(tokens), log_probs=torch.tensor([-0.25, -1.5])[: len(tokens)],
                            finish_reason=reason, weight_version=6, seed=17, error=error)


def test_answers_in_sglang_shape_and_back():
    items, _ = parse_generate({"input_ids": [1, 2, 3], "rid": "q", "return_logprob": True}, EOS)
    for reason, kind in [("stop", "stop"), ("length", "length"), ("context", "length"), ("abort", "abort")]:
        data = answer(_result(reason), items[0], "text")
        meta = data["meta_info"]
        assert meta["finish_reason"]["type"] == kind and meta["orthon_finish_reason"] == reason
        assert (data["output_ids"], data["text"], meta["id"]) == ([4, 9], "text", "q")
        assert (meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (3, 2, "6")
        assert meta["output_token_logprobs"] == [[-0.25, 4, None], [-1.5, 9, None]]
        back = result_from_answer(data, [1, 2, 3], SamplingParams(), fallback_version=0)
        assert (back.tokens, back.finish_reason, back.weight_version, back.seed) == ([4, 9], reason, 6, 17)
        assert back.log_probs.dtype == torch.float32 and back.log_probs.tolist() == [-0.25, -1.5]
    assert finish_reason(_result("stop")) == {"type": "stop", "matched": 9}
    assert finish_reason(_result("length")) == {"type": "length", "length": 2}
    assert finish_reason(_result("abort", (), "paused"))["message"] == "paused"


def test_a_real_sglang_answer_parses():
    # SGLang's own shape: no orthon fields, weight_version "default" until an update names one.
    data = {"text": " 4", "output_ids": [17, 2],
            "meta_info": {"id": "abc", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 3,
                          "completion_tokens": 2, "cached_tokens": 0, "weight_version": "default",
                          "output_token_logprobs": [[-0.5, 17, None], [-0.125, 2, None]], "e2e_latency": 0.1}}
    result = result_from_answer(data, [1, 2, 3], SamplingParams(seed=5), fallback_version=4)
    assert (result.finish_reason, result.weight_version, result.seed, result.tokens) == ("stop", 4, 5, [17, 2])
    assert result.log_probs.tolist() == [-0.5, -0.125]


@pytest.mark.parametrize("data,match", [
    ("hello", "no meta_info"),
    ({"output_ids": [1], "meta_info": {"finish_reason": {"type": "stop"}}}, "no output_token_logprobs"),
    ({"output_ids": [1], "meta_info": {"finish_reason": {"type": "weird"}}}, "finish_reason"),
    ({"output_ids": "x", "meta_info": {}}, "output_ids"),
    ({"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "length"},
                                          "output_token_logprobs": [[-1.0, 1, None]]}}, "one \\[logprob"),
])
def test_garbage_answers_raise(data, match):
    with pytest.raises(ValueError, match=match):
        result_from_answer(data, [1], SamplingParams(), 0)


def test_error_messages_of_every_shape():
    assert error_message({"error": "bad ids"}) == "bad ids"
    assert error_message({"error": {"message": "sglang says"}}) == "sglang says"
    assert error_message({"object": "error", "message": "openai style"}) == "openai style"
    assert error_message({"detail": "fastapi"}) == "fastapi"
    assert error_message("plain text") == "plain text"
