"""`orthon serve` as a real subprocess, driven over HTTP and through HTTPEngine: greedy and seeded
generation equal the in-process engine's on the same weights, concurrent callers share engine calls,
pause / abort / continue, every kind of bad input is a 400 (413 over the size limit) after which the
server still serves, weight updates from disk, delta payloads (a wrong base refused, weights
unchanged), shared memory and a gloo broadcast, SIGTERM; and the client against servers that hang,
refuse or answer garbage."""
import http.client
import json
import shutil
import signal
import socketserver
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from orthon.core.errors import CheckpointError, EngineUnavailable
from orthon.core.net import free_port
from orthon.engine.client import HTTPEngine
from orthon.engine.in_process import InProcessEngine
from orthon.engine.protocol import Engine
from orthon.engine.sampling import SamplingParams
from orthon.pretrain.weights import load_weights
from server_support import ServerProcess, tiny_weights
from test_data_support import hf_tokenizer_json

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 9, 14, 3], [7, 7, 30, 41, 2, 19, 100], [60]]
GREEDY = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=())
SAMPLED = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, seed=11, stop_token_ids=())
LIMIT = 64 * 1024  # the servers' --max-body-bytes here


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    return tiny_weights(root / "base"), tiny_weights(root / "other", seed=123)


@pytest.fixture(scope="module")
def served(weights, tmp_path_factory):
    """The base weights with a tokenizer.json beside them, as an HF checkpoint keeps it."""
    directory = tmp_path_factory.mktemp("served") / "weights"
    shutil.copytree(weights[0], directory)
    hf_tokenizer_json(directory / "tokenizer.json")
    return directory


@pytest.fixture(scope="module")
def server(served, tmp_path_factory):
    """The read-only tests' server (the base weights, a tokenizer): its weights never change."""
    process = ServerProcess(served, tmp_path_factory.mktemp("logs") / "server.log", "--max-body-bytes", str(LIMIT)).wait()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def mutable(weights, tmp_path_factory):
    """The weight-update tests' server."""
    process = ServerProcess(weights[0], tmp_path_factory.mktemp("logs") / "mutable.log").wait()
    yield process
    process.stop()


def _request(url: str, method: str, path: str, payload=None, raw: bytes | None = None, timeout_s: float = 120.0):
    """(status, JSON answer) of one plain HTTP call."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    body = raw if raw is not None else (None if payload is None else json.dumps(payload).encode())
    try:
        kind = "application/octet-stream" if raw is not None else "application/json"
        connection.request(method, path, body=body, headers={"Content-Type": kind})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def _info(url: str) -> dict:
    return _request(url, "GET", "/get_server_info")[1]


def _wait_waiting(url: str, count: int, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _info(url)["batching"]["waiting"] < count:
        assert time.monotonic() < deadline, f"{count} requests never queued: {_info(url)['batching']}"
        time.sleep(0.05)


def _named(model):
    """The model's tensors as the trainer sends them: the HF layout, routed experts one tensor each."""
    from orthon.pretrain.hf_io import experts_to_hf

    return list(experts_to_hf({name: t.detach() for name, t in model.state_dict().items()}).items())


def _reference(weights_dir, sampling=GREEDY, prompts=PROMPTS):
    return InProcessEngine(load_weights(weights_dir).eval()).generate(prompts, sampling)


# ---------------------------------------------------------------- generation
def test_greedy_generate_equals_the_in_process_engine(server, weights):
    reference = _reference(weights[0])
    status, answers = _request(server.url, "POST", "/generate", {
        "input_ids": PROMPTS, "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
        "return_logprob": True, "rid": ["a", "b", "c"]})
    assert status == 200 and len(answers) == 3
    for ans, ref, prompt, rid in zip(answers, reference, PROMPTS, "abc"):
        meta = ans["meta_info"]
        assert ans["output_ids"] == ref.tokens and len(ref.tokens) == 10
        got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])
        # To float round-off: the server may take a prompt's start from its prefix cache (tests before).
        torch.testing.assert_close(got, ref.log_probs, atol=2e-5, rtol=0)
        assert [t for _, t, _ in meta["output_token_logprobs"]] == ref.tokens
        assert meta["finish_reason"] == {"type": "length", "length": 10}
        assert (meta["id"], meta["prompt_tokens"], meta["completion_tokens"], meta["weight_version"]) == (rid, len(prompt), 10, "0")
    single = _request(server.url, "POST", "/generate", {"input_ids": PROMPTS[1], "return_logprob": False,
                                                        "sampling_params": {"max_new_tokens": 10, "temperature": 0,
                                                                            "ignore_eos": True}})[1]
    assert single["output_ids"] == reference[1].tokens and "output_token_logprobs" not in single["meta_info"]
    # The batch before ran this prompt: all of it but the last token (which must run to give the first
    # response token's logits) came from the prefix cache, as SGLang reports it.
    assert single["meta_info"]["cached_tokens"] == len(PROMPTS[1]) - 1

    client = HTTPEngine(server.url)
    results = client.generate(PROMPTS, GREEDY)
    for got, ref in zip(results, reference):
        assert (got.tokens, got.finish_reason, got.weight_version, got.prompt) == (ref.tokens, "length", 0, ref.prompt)
        assert got.log_probs.dtype == torch.float32
        torch.testing.assert_close(got.log_probs, ref.log_probs, atol=2e-5, rtol=0)


def test_seeded_sampling_through_the_client_equals_the_in_process_engine(server, weights):
    # One shared SamplingParams with seed s: request i draws from seed s + i on both engines, whatever
    # the server's waves hold, so tokens match; log-probs to float round-off of other batch shapes.
    reference = _reference(weights[0], SAMPLED)
    results = HTTPEngine(server.url).generate(PROMPTS, SAMPLED, routing_keys=["s1", "s1", "s2"])
    assert [r.seed for r in results] == [11, 12, 13]
    for got, ref in zip(results, reference):
        assert got.tokens == ref.tokens
        torch.testing.assert_close(got.log_probs, ref.log_probs, atol=1e-5, rtol=0)


def test_stop_tokens_keep_their_meaning_over_http(server, weights):
    ref = _reference(weights[0], GREEDY)[0]
    stop = ref.tokens[3]
    first = ref.tokens.index(stop)
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(stop,))
    got = HTTPEngine(server.url).generate([PROMPTS[0]], params)[0]
    assert (got.tokens, got.finish_reason) == (ref.tokens[: first + 1], "stop")


def _generate_concurrently(url: str, count: int, max_new_tokens: int) -> list[dict]:
    barrier = threading.Barrier(count)

    def call(i):
        barrier.wait()
        return _request(url, "POST", "/generate", {"input_ids": [3 + i, 4, 5], "sampling_params": {
            "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}})

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(call, range(count)))


def test_sixteen_concurrent_callers_share_engine_calls(server):
    client = HTTPEngine(server.url)
    # Held while they arrive: the sixteen run as one engine call.
    client.pause(mode="retract")
    before = _info(server.url)["batching"]
    with ThreadPoolExecutor(1) as pool:
        answers = pool.submit(_generate_concurrently, server.url, 16, 6)
        _wait_waiting(server.url, 16)
        client.resume()
        answers = answers.result()
    after = _info(server.url)["batching"]
    assert [status for status, _ in answers] == [200] * 16
    assert all(len(a["output_ids"]) == 6 for _, a in answers)
    assert after["generate_calls"] - before["generate_calls"] == 1
    assert after["batch_sizes"]["16"] == before["batch_sizes"].get("16", 0) + 1
    assert after["max_batch"] >= 16
    # Not held: whoever arrives while a call runs joins the next one.
    before = after
    answers = _generate_concurrently(server.url, 16, 24)
    after = _info(server.url)["batching"]
    assert [status for status, _ in answers] == [200] * 16
    assert after["requests"] - before["requests"] == 16
    assert after["generate_calls"] - before["generate_calls"] <= 8


def test_pause_abort_and_continue(server):
    client = HTTPEngine(server.url)
    client.pause(mode="retract")  # requests wait
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    aborted_before = _info(server.url)["batching"]["aborted"]
    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(_request, server.url, "POST", "/generate", {**body, "rid": "wait-1"})
        second = pool.submit(_request, server.url, "POST", "/generate", {**body, "rid": "wait-2"})
        _wait_waiting(server.url, 2)
        assert _request(server.url, "POST", "/abort_request", {"rid": "wait-1"}) == (200, {"success": True, "aborted": 1})
        status, answer = first.result(60)
        assert status == 200 and answer["output_ids"] == [] and answer["meta_info"]["finish_reason"]["type"] == "abort"
        assert not second.done()
        # Pausing in "abort" mode returns every waiting request aborted.
        third = pool.submit(client.generate, [[4, 5, 6]], GREEDY)
        _wait_waiting(server.url, 2)
        client.pause(mode="abort")
        status, answer = second.result(60)
        assert (status, answer["meta_info"]["finish_reason"]["type"], answer["meta_info"]["id"]) == (200, "abort", "wait-2")
        result = third.result(60)[0]
        assert (result.finish_reason, result.tokens, result.log_probs.numel()) == ("abort", [], 0)
    assert _info(server.url)["batching"]["aborted"] == aborted_before + 3
    assert _request(server.url, "GET", "/health_generate")[0] == 503  # paused: no generation
    client.resume()
    assert len(client.generate([[4, 5, 6]], GREEDY)[0].tokens) == 10


# ---------------------------------------------------------------- bad input
BAD = [
    ("/generate", b"{not json", 400, "not valid JSON"),
    ("/generate", {"sampling_params": {"max_new_tokens": 2}}, 400, "missing input_ids"),
    ("/generate", {"input_ids": [5, 320]}, 400, "token id 320 is outside the vocabulary (0..319)"),
    ("/generate", {"input_ids": [[5], [5, 900]]}, 400, r"input_ids[1]: token id 900"),
    ("/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": -3}}, 400, "max_new_tokens: must be an int >= 0"),
    ("/generate", {"input_ids": [5], "sampling_params": {"min_p": 0.2}}, 400, "min_p: not supported"),
    ("/generate", {"input_ids": [5] * 5000}, 400, "leave no room for a response"),
    ("/generate", b"[" + b"1," * LIMIT + b"1]", 413, f"over this route's limit of {LIMIT} bytes"),
    ("/generate", {"text": ["hello", 5]}, 400, "text: expected a string or a non-empty list of strings"),
    ("/generate", b"", 400, "empty"),
    ("/update_weights_from_disk", {"model_path": "/nonexistent/weights"}, 400, "no such weights"),
    ("/update_weights_from_disk", {"model_path": "/x", "weight_version": "v2"}, 400, "weight_version"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}, 400, "no such weight-update group"),
    ("/orthon/update_weights_from_delta", b"not a delta", 400, "delta payload"),
    ("/orthon/update_weights_from_delta", {"path": "/nonexistent.bin"}, 400, "is not a delta payload file"),
    ("/orthon/update_weights_from_shared", {"handle": {"path": "/nonexistent"}}, 400, "shared weights handle"),
    ("/pause_generation", {"mode": "sideways"}, 400, "mode: expected one of"),
    ("/abort_request", {}, 400, "rid: expected"),
]


@pytest.mark.parametrize("path,body,status,message", BAD, ids=[f"{p}:{m[:24]}" for p, _, _, m in BAD])
def test_bad_input_is_refused_with_a_message_and_the_server_goes_on(server, path, body, status, message):
    version = _request(server.url, "GET", "/get_weight_version")[1]
    got_status, answer = _request(server.url, "POST", path, **({"raw": body} if isinstance(body, bytes) else {"payload": body}))
    assert got_status == status
    assert message in answer["error"]
    assert _request(server.url, "GET", "/get_weight_version")[1] == version  # nothing changed
    status, good = _request(server.url, "POST", "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and len(good["output_ids"]) == 2


def test_the_client_maps_refused_requests_to_rejected_results(server, weights):
    client = HTTPEngine(server.url)
    results = client.generate([[5, 320], PROMPTS[0], []], GREEDY)
    assert [r.finish_reason for r in results] == ["rejected", "length", "rejected"]
    assert "token id 320 is outside the vocabulary" in results[0].error and "input_ids" in results[2].error
    assert results[1].tokens == _reference(weights[0], GREEDY, [PROMPTS[0]])[0].tokens
    assert client.stats["rejected"] == 2
    with pytest.raises(TypeError, match="weights path or a DeltaPayload"):
        client.update_weights({"lm_head.weight": torch.zeros(1)})


def test_text_requests_use_the_tokenizer_beside_the_weights(server, served, weights, mutable):
    from orthon.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(served / "tokenizer.json")
    text = "def f(x): return x"
    status, answers = _request(server.url, "POST", "/generate", {
        "text": [text, "hello world"], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
    assert status == 200
    prompts = [tokenizer.encode(text), tokenizer.encode("hello world")]
    reference = _reference(weights[0], SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=()), prompts)
    for answer, prompt, ref in zip(answers, prompts, reference):
        assert answer["meta_info"]["prompt_tokens"] == len(prompt) and answer["output_ids"] == ref.tokens
        assert answer["text"] == tokenizer.decode(ref.tokens)
    assert _info(server.url)["tokenizer_path"] == str(served.resolve() / "tokenizer.json")
    status, answer = _request(mutable.url, "POST", "/generate", {"text": "hello"})  # weights without a tokenizer
    assert status == 400 and "no tokenizer" in answer["error"]


def test_stop_strings_over_http_end_where_the_in_process_engine_ends(server, served, weights, mutable):
    from orthon.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(served / "tokenizer.json")
    free = _reference(weights[0], GREEDY, PROMPTS[:1])[0]
    text = tokenizer.decode(free.tokens)
    stop = text[len(text) // 2: len(text) // 2 + 2]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(), stop=(stop,))
    ref = InProcessEngine(load_weights(weights[0]).eval(), tokenizer=tokenizer).generate(PROMPTS[:1], params)[0]
    assert ref.matched_stop == stop and len(ref.tokens) < len(free.tokens) and ref.tokens == free.tokens[:len(ref.tokens)]
    got = HTTPEngine(server.url).generate(PROMPTS[:1], params)[0]
    assert (got.tokens, got.finish_reason, got.matched_stop) == (ref.tokens, "stop", stop)
    body = {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True,
                                                         "stop": [stop]}}
    status, answer = _request(server.url, "POST", "/generate", body)
    full = tokenizer.decode(ref.tokens)
    assert status == 200 and answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert answer["text"] == full[:full.index(stop)] and answer["output_ids"] == ref.tokens
    body["sampling_params"]["no_stop_trim"] = True
    assert _request(server.url, "POST", "/generate", body)[1]["text"] == full
    # Refused by name: stop strings where the server has no tokenizer, an empty text.
    status, answer = _request(mutable.url, "POST", "/generate", body)
    assert status == 400 and answer["error"].startswith("sampling_params.stop: this server has no tokenizer")
    status, answer = _request(server.url, "POST", "/generate", {"text": ""})
    assert status == 400 and answer["error"] == "text: empty (no token ids to continue)"


def _stream(url: str, payload: dict, timeout_s: float = 120.0) -> tuple[int, str, list]:
    """(status, content type, the data of each server-sent event) of a streamed /generate."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        connection.request("POST", "/generate", body=json.dumps(payload).encode(),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        raw = response.read().decode()
        events = [block.removeprefix("data: ") for block in raw.split("\n\n") if block]
        return response.status, response.getheader("content-type"), [e if e == "[DONE]" else json.loads(e) for e in events]
    finally:
        connection.close()


def test_a_streamed_generate_sends_each_prefix_then_the_answer(server, served):
    from orthon.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(served / "tokenizer.json")
    body = {"input_ids": PROMPTS[1], "rid": "s", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    whole = _request(server.url, "POST", "/generate", body)[1]
    status, kind, events = _stream(server.url, {**body, "stream": True})
    assert status == 200 and kind.startswith("text/event-stream") and events[-1] == "[DONE]"
    *partial, final = events[:-1]
    # The last event is the whole answer, but for the prompt tokens the request before left in the
    # cache, and the log-probs then differ by float round-off.
    assert final["meta_info"].pop("cached_tokens") == len(PROMPTS[1]) - 1
    whole["meta_info"].pop("cached_tokens")
    logprobs = [torch.tensor([e[0] for e in answer["meta_info"].pop("output_token_logprobs")]) for answer in (final, whole)]
    torch.testing.assert_close(*logprobs, atol=2e-5, rtol=0)
    assert final == whole
    ids = whole["output_ids"]
    # One a token, or fewer where the client read late (merged into the newest): 200 tokens take long
    # enough that some arrive before the end.
    assert 2 <= len(partial) <= len(ids)
    for event in partial:
        n = event["meta_info"]["completion_tokens"]
        assert event["output_ids"] == ids[:n] and event["text"] == tokenizer.decode(ids[:n])
        assert event["meta_info"]["finish_reason"] is None and event["meta_info"]["id"] == "s"
    assert [e["meta_info"]["completion_tokens"] for e in partial] == sorted({e["meta_info"]["completion_tokens"] for e in partial})
    # A refused request streams one error event; a batch cannot stream.
    assert _stream(server.url, {"input_ids": [5, 999], "stream": True})[2] == [
        {"error": "input_ids: token id 999 is outside the vocabulary (0..319)"}, "[DONE]"]
    status, answer = _request(server.url, "POST", "/generate", {"input_ids": [[5], [6]], "stream": True})
    assert status == 400 and answer["error"].startswith("stream: one request at a time")


def test_a_short_request_is_answered_before_the_long_one_of_its_wave_ends(server):
    long = {"input_ids": [4, 5, 6], "rid": "long-wave", "sampling_params": {"max_new_tokens": 3000, "temperature": 0,
                                                                             "ignore_eos": True}}
    short = {"input_ids": [7, 8], "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}}
    client = HTTPEngine(server.url)
    client.pause(mode="retract")  # both wait, then run as one wave
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(_request, server.url, "POST", "/generate", long)
        _wait_waiting(server.url, 1)
        answered = pool.submit(_request, server.url, "POST", "/generate", short)
        _wait_waiting(server.url, 2)
        calls = _info(server.url)["batching"]["generate_calls"]
        client.resume()
        status, answer = answered.result(60)
        assert status == 200 and len(answer["output_ids"]) == 2
        info = _info(server.url)["batching"]
        assert info["generate_calls"] == calls + 1 and info["running"] == 2 and not running.done()
        assert _request(server.url, "POST", "/abort_request", {"rid": "long-wave"})[1]["aborted"] == 1
        assert running.result(60)[1]["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_request_arriving_while_a_wave_decodes_joins_it(server, weights):
    """Continuous batching: a request that arrives while a long one decodes joins its wave (no new engine
    call), is answered as it would be alone, and before the long one ends."""
    long = {"input_ids": [4, 5, 6, 7, 8, 9], "rid": "long-join", "sampling_params": {
        "max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_request, server.url, "POST", "/generate", long)
        deadline = time.monotonic() + 60
        while _info(server.url)["batching"]["running"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        before = _info(server.url)["batching"]
        got = HTTPEngine(server.url).generate([PROMPTS[0]], GREEDY)[0]
        after = _info(server.url)["batching"]
        assert not running.done() and after["generate_calls"] == before["generate_calls"]
        assert after["joined"] == before["joined"] + 1
        assert _request(server.url, "POST", "/abort_request", {"rid": "long-join"})[1]["aborted"] == 1
        running.result(60)
    ref = _reference(weights[0], GREEDY, [PROMPTS[0]])[0]
    assert got.tokens == ref.tokens
    torch.testing.assert_close(got.log_probs, ref.log_probs, atol=2e-5, rtol=0)


def test_abort_stops_a_running_request_with_its_tokens_so_far(server):
    body = {"input_ids": [4, 5, 6], "rid": "long", "return_logprob": True,
            "sampling_params": {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}}
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_request, server.url, "POST", "/generate", body)
        deadline = time.monotonic() + 60
        while _info(server.url)["batching"]["running"] < 1:
            assert time.monotonic() < deadline and not running.done()
            time.sleep(0.02)
        time.sleep(0.2)  # some tokens in
        assert _request(server.url, "POST", "/abort_request", {"rid": "long"}) == (200, {"success": True, "aborted": 1})
        status, answer = running.result(60)
    meta = answer["meta_info"]
    assert status == 200 and meta["finish_reason"] == {"type": "abort", "message": "aborted by request"}
    assert 0 < len(answer["output_ids"]) < 3000 and len(meta["output_token_logprobs"]) == len(answer["output_ids"])
    greedy = _request(server.url, "POST", "/generate", {**body, "rid": "again", "sampling_params": {
        **body["sampling_params"], "max_new_tokens": len(answer["output_ids"])}})[1]
    assert greedy["output_ids"] == answer["output_ids"]  # the tokens so far are the ones the run would give
    # A stream whose client goes away is aborted, not left generating.
    aborted = _info(server.url)["batching"]["aborted"]
    host, port = server.url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request("POST", "/generate", body=json.dumps({**body, "rid": "gone", "stream": True}).encode(),
                       headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.read(6) == b"data: "
    connection.sock.shutdown(2)
    connection.close()
    deadline = time.monotonic() + 30
    while _info(server.url)["batching"]["aborted"] == aborted or _info(server.url)["batching"]["running"]:
        assert time.monotonic() < deadline, _info(server.url)["batching"]
        time.sleep(0.05)


def test_health_and_info_routes(server, served):
    assert _request(server.url, "GET", "/health") == (200, {})
    assert _request(server.url, "GET", "/health_generate") == (200, {"ok": True, "weight_version": "0"})
    info = _info(server.url)
    assert info["model_path"] == str(served.resolve()) and info["weight_version"] == "0"
    assert info["max_batch_size"] == 64 and info["max_total_tokens"] == 4096 and info["engine_health"]["ok"] is True
    assert info["max_body_bytes"] == LIMIT and info["engine"] == "orthon"
    for path in ("/get_model_info", "/model_info"):
        model = _request(server.url, "GET", path)[1]
        assert model["architectures"] == ["GlmMoeDsaForCausalLM"] and model["vocab_size"] == 320
        assert model["model_path"] == str(served.resolve()) and model["config"]["num_hidden_layers"] == 2
    assert _request(server.url, "GET", "/server_info")[1]["model_path"] == info["model_path"]
    assert _request(server.url, "POST", "/flush_cache")[0] == 200
    assert isinstance(HTTPEngine(server.url), Engine)
    health = HTTPEngine(server.url).health()
    assert (health["ok"], health["weight_version"], health["server"]["model_path"]) == (True, 0, info["model_path"])


def test_sigterm_returns_waiting_requests_aborted_and_exits(weights, tmp_path):
    process = ServerProcess(weights[0], tmp_path / "server.log").wait()
    client = HTTPEngine(process.url, timeout_s=60)
    client.pause(mode="retract")
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(client.generate, [[4, 5]], GREEDY)
        _wait_waiting(process.url, 1)
        code = process.stop(signal.SIGTERM)
        result = waiting.result(60)[0]
    assert code == -signal.SIGTERM  # uvicorn re-raises the signal once it has shut down
    assert (result.finish_reason, result.error) == ("abort", "the server is shutting down")
    assert "Traceback" not in (tmp_path / "server.log").read_text()


# ---------------------------------------------------------------- weight updates
def test_update_weights_from_disk_changes_outputs_and_version(mutable, weights, tmp_path):
    client = HTTPEngine(mutable.url)
    before = client.generate(PROMPTS, GREEDY)
    assert client.update_weights(str(weights[1]), version=7) == 7
    after = client.generate(PROMPTS, GREEDY)
    assert [r.tokens for r in after] == [r.tokens for r in _reference(weights[1])]
    assert [r.tokens for r in after] != [r.tokens for r in before]
    assert {r.weight_version for r in after} == {7}
    assert _info(mutable.url)["model_path"] == str(weights[1])
    assert client.update_weights(str(weights[0])) == 8  # no version named: the old one + 1
    assert [r.tokens for r in client.generate(PROMPTS, GREEDY)] == [r.tokens for r in before]
    with pytest.raises(CheckpointError, match="no such weights directory or file"):
        client.update_weights(str(tmp_path / "missing"), version=9)
    assert client.get_weight_version() == 8 and _info(mutable.url)["weight_updates"] >= 2


def test_a_weight_update_waits_for_the_running_wave(mutable, weights):
    client = HTTPEngine(mutable.url)
    client.update_weights(str(weights[0]), version=10)
    long = SamplingParams(max_new_tokens=150, temperature=0.0, stop_token_ids=())
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(client.generate, [PROMPTS[0]], long)
        deadline = time.monotonic() + 60
        while _info(mutable.url)["batching"]["running"] == 0:
            assert time.monotonic() < deadline and not running.done(), "the long request never ran"
            time.sleep(0.01)
        assert client.update_weights(str(weights[1]), version=11) == 11  # returns after the wave
        result = running.result(120)[0]
    # The whole wave ran on the old weights: an update in the middle would have changed its tokens.
    assert result.weight_version == 10
    assert result.tokens == _reference(weights[0], long, [PROMPTS[0]])[0].tokens
    assert client.generate([PROMPTS[0]], GREEDY)[0].weight_version == 11


def test_delta_payloads_apply_in_place_and_a_wrong_base_changes_nothing(mutable, weights, tmp_path):
    from orthon.engine.delta import DeltaEncoder
    from orthon.engine.tensor_bytes import tensor_hashes
    from orthon.engine.weight_transfer import write_delta

    base, other = load_weights(weights[0]), load_weights(weights[1])
    client = HTTPEngine(mutable.url)
    client.update_weights(str(weights[0]), version=20)
    encoder = DeltaEncoder()
    encoder.reset(_named(base), 20)
    payload = encoder.encode(_named(other), 21)

    stale = DeltaEncoder()
    stale.reset(_named(base), 19)
    with pytest.raises(CheckpointError, match="from weight version 19, the engine holds 20"):
        client.update_weights(stale.encode(_named(other), 21))
    wrong_bytes = DeltaEncoder()  # the right version number on other bytes: the base hashes refuse it
    wrong_bytes.reset(_named(other), 20)
    with pytest.raises(CheckpointError, match=r"\(409\).*not this delta's base"):
        client.update_weights(wrong_bytes.encode(_named(base), 21))
    damaged = bytearray(payload.to_bytes())
    damaged[-1] ^= 0xFF
    status, answer = _request(mutable.url, "POST", "/orthon/update_weights_from_delta", raw=bytes(damaged))
    assert status == 400 and "checksum mismatch" in answer["error"]
    assert client.weight_hashes() == tensor_hashes(_named(base)) and client.get_weight_version() == 20

    assert client.update_weights(payload) == 21
    assert client.weight_hashes() == tensor_hashes(_named(other))
    assert [r.tokens for r in client.generate(PROMPTS, GREEDY)] == [r.tokens for r in _reference(weights[1])]
    back = write_delta(tmp_path, encoder.encode(_named(base), 22))
    assert client.update_weights_from_delta_file(back) == 22
    assert client.weight_hashes() == tensor_hashes(_named(base))


def test_shared_memory_and_broadcast_updates(mutable, weights, tmp_path):
    from orthon.engine.delta import DELTA_TENSOR_NAME, DeltaEncoder
    from orthon.engine.tensor_bytes import tensor_hashes
    from orthon.engine.weight_transfer import (SharedBuckets, TensorMeta, broadcast_bytes, broadcast_tensors,
                                               open_update_group)

    base, other = load_weights(weights[0]), load_weights(weights[1])
    client = HTTPEngine(mutable.url)
    with SharedBuckets(tmp_path) as shared:
        assert client.update_weights_from_shared(shared.write(_named(other), 30)) == 30
    assert client.weight_hashes() == tensor_hashes(_named(other))

    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 2, timeout_s=60)
        group = open_update_group("127.0.0.1", port, 0, 2, timeout_s=60)
        joined.result(90)
        try:
            assert _info(mutable.url)["weight_update_groups"] == ["weight_update_group"]
            metas = [TensorMeta.of(name, t) for name, t in _named(base)]
            received = pool.submit(client.update_weights_from_distributed, metas, 31)
            broadcast_tensors(group, _named(base))
            assert received.result(90) == 31
            assert client.weight_hashes() == tensor_hashes(_named(base))
            # Deltas over the same group: as bytes, and as one uint8 tensor.
            encoder = DeltaEncoder()
            encoder.reset(_named(base), 31)
            received = pool.submit(client.update_weights_from_distributed, [], delta=True)
            broadcast_bytes(group, encoder.encode(_named(other), 32).to_bytes())
            assert received.result(90) == 32
            assert client.weight_hashes() == tensor_hashes(_named(other))
            blob = torch.frombuffer(bytearray(encoder.encode(_named(base), 33).to_bytes()), dtype=torch.uint8)
            received = pool.submit(client.update_weights_from_distributed, [TensorMeta.of(DELTA_TENSOR_NAME, blob)])
            broadcast_tensors(group, [(DELTA_TENSOR_NAME, blob)])
            assert received.result(90) == 33
            assert client.weight_hashes() == tensor_hashes(_named(base))
            # A delta for another base, broadcast: refused (409), the weights stay.
            stale = DeltaEncoder()
            stale.reset(_named(base), 5)
            received = pool.submit(client.update_weights_from_distributed, [], delta=True)
            broadcast_bytes(group, stale.encode(_named(other), 34).to_bytes())
            with pytest.raises(CheckpointError, match=r"\(409\).*from weight version 5, the engine holds 33"):
                received.result(90)
            assert client.weight_hashes() == tensor_hashes(_named(base))
        finally:
            group.close()
    assert [r.tokens for r in client.generate(PROMPTS, GREEDY)] == [r.tokens for r in _reference(weights[0])]


def _second_fails(loaders: list) -> tuple[list, list]:
    """``loaders`` whose second raises "out of memory", and the list of the indices called, in order."""
    calls = []

    def failing(i, load):
        calls.append(i)
        if i == 1:
            raise RuntimeError("out of memory")
        return load()

    return calls, [lambda i=i, load=load: failing(i, load) for i, load in enumerate(loaders)]


def test_weights_streamed_in_parts_and_a_failed_stream_asks_for_a_full_copy(mutable, weights, tmp_path):
    """The trainer's streamed sync (orthon.rl.weight_sync, distributed without delta): parts of the model
    (gathered_parts, one process: plain tensors) broadcast one after another leave the engine with the
    new weights, resumed; a part that fails mid-stream (rank 0 out of memory) still lets every later loader
    run (the other ranks' gathers), resumes the engine, and raises IncompleteSync naming the version's
    directory, from which the full copy brings the engine to the trainer's bytes."""
    from orthon.engine.tensor_bytes import tensor_hashes
    from orthon.pretrain.gathered_weights import gathered_parts
    from orthon.rl.config import ClusterConfig
    from orthon.rl.weight_sync import IncompleteSync, SyncForm, WeightParts, WeightSync
    from orthon.pretrain.weights import save_weights

    base, other = load_weights(weights[0]), load_weights(weights[1])
    client = HTTPEngine(mutable.url)
    sync = WeightSync(ClusterConfig(weight_sync="distributed", delta=False, check_weights=True, part_bytes=30_000),
                      tmp_path)
    assert sync.form(40) == SyncForm(part_bytes=30_000)
    loaders = gathered_parts(other, 0, 30_000)
    assert len(loaders) >= 4
    assert sync.push(WeightParts(loaders), 40, [client]) == []  # check_weights: raises on any difference
    assert client.weight_hashes() == tensor_hashes(_named(other)) and client.health()["weight_version"] == 40
    assert [r.tokens for r in client.generate(PROMPTS, GREEDY)] == [r.tokens for r in _reference(weights[1])]

    calls, loaders = _second_fails(gathered_parts(base, 0, 30_000))
    with pytest.raises(IncompleteSync, match="out of memory") as failed:
        sync.push(WeightParts(loaders), 41, [client])
    assert calls == list(range(len(loaders)))  # every part still gathered once, in order
    assert failed.value.directory == tmp_path / "weights" / "v00000041"
    assert client.generate(PROMPTS[:1], GREEDY)[0].tokens  # resumed (a paused engine would not answer)
    assert sync.push(save_weights(base, failed.value.directory), 41, [client]) == []
    assert client.weight_hashes() == tensor_hashes(_named(base))
    assert [r.tokens for r in client.generate(PROMPTS, GREEDY)] == [r.tokens for r in _reference(weights[0])]


def test_a_pipeline_stage_streams_over_its_own_group_and_a_failure_asks_for_a_full_copy(mutable, weights, tmp_path):
    """The pipelined trainer's distributed sync (orthon.rl.stage_sync), one stage in one process: its leader
    forms a weight-update group of its own with the engine and broadcasts the stage's parts over it; the
    engine, paused throughout, ends on the new weights at the new version, resumed, and the parts are
    counted. A part that fails mid-stream still lets every later loader run (the stage's other ranks wait
    in their gathers), resumes the engine and raises IncompleteSync naming the version's directory."""
    from types import SimpleNamespace

    from orthon.engine.tensor_bytes import tensor_hashes
    from orthon.pretrain.gathered_weights import gathered_parts
    from orthon.rl.config import ClusterConfig
    from orthon.rl.stage_sync import StageSender, run_stages
    from orthon.rl.weight_sync import IncompleteSync, StageParts, WeightSync

    base, other = load_weights(weights[0]), load_weights(weights[1])
    client = HTTPEngine(mutable.url)
    sync = WeightSync(ClusterConfig(weight_sync="distributed", delta=False, check_weights=True, part_bytes=30_000),
                      tmp_path)
    sender = StageSender(0)

    def stage_sync(loaders, version):
        stage = SimpleNamespace(stage=0, loaders=loaders, leader=True)
        return StageParts(lambda urls: run_stages(stage, sender, version, HTTPEngine, True, urls), stages=1)

    parts = stage_sync(gathered_parts(other, 0, 30_000), 50)
    assert sync.push(parts, 50, [client]) == []  # check_weights: raises on any difference
    assert parts.sent >= 4 and sender.group.name == "orthon_pipeline_stage_0" and sender.group.group is not None
    assert client.weight_hashes() == tensor_hashes(_named(other)) and client.health()["weight_version"] == 50
    assert [r.tokens for r in client.generate(PROMPTS, GREEDY)] == [r.tokens for r in _reference(weights[1])]

    calls, loaders = _second_fails(gathered_parts(base, 0, 30_000))
    with pytest.raises(IncompleteSync, match=r"rank 0 \(pipeline stage 0\): RuntimeError: out of memory") as failed:
        sync.push(stage_sync(loaders, 51), 51, [client])
    assert calls == list(range(len(loaders)))  # every part still gathered once, in order
    assert failed.value.directory == tmp_path / "weights" / "v00000051"
    assert sender.group.group is None  # closed after the failure: formed again at the next sync
    assert client.generate(PROMPTS[:1], GREEDY)[0].tokens  # resumed (a paused engine would not answer)


def test_each_ranks_delta_of_its_rows_and_a_failed_one_asks_for_a_full_copy(mutable, weights, tmp_path):
    """Delta where the trainer ranks hold shards (orthon.rl.weight_sync, disk with delta): after a full copy
    from a directory, a version comes as two ranks' payload files of their rows, the first not final; the
    engine ends on the trainer's bytes at that version and the files are gone. A damaged payload stops the
    stream: the engine is resumed, IncompleteSync names the directory for a full copy, and no delta is
    taken until that copy is in."""
    from orthon.engine.delta import DeltaEncoder
    from orthon.pretrain.hf_io import row_piece_name
    from orthon.engine.tensor_bytes import tensor_hashes
    from orthon.pretrain.weights import save_weights
    from orthon.rl.config import ClusterConfig
    from orthon.rl.weight_sync import IncompleteSync, ShardDeltas, SyncForm, WeightSync

    base, other = load_weights(weights[0]), load_weights(weights[1])
    client = HTTPEngine(mutable.url)
    sync = WeightSync(ClusterConfig(weight_sync="disk", delta=True), tmp_path)
    root = tmp_path / "weights"
    assert sync.form(50) == SyncForm(directory=root / "v00000050")  # no base yet: a full copy
    assert sync.push(save_weights(base, root / "v00000050"), 50, [client]) == []
    assert sync.form(51) == SyncForm(delta_directory=root / "delta-v00000051")

    def rows(model, rank):  # rank 0 the first half of every tensor's rows, rank 1 the rest
        out = []
        for name, t in model.state_dict().items():
            cut = t.shape[0] // 2 if t.dim() else 0
            first, last = (0, cut) if rank == 0 else (cut, t.shape[0] if t.dim() else 0)
            if t.dim() and first < last:
                out.append((row_piece_name(name, first, last), t[first:last]))
            elif not t.dim() and rank == 0:
                out.append((name, t))
        return out

    encoders = [DeltaEncoder(), DeltaEncoder()]
    for rank, encoder in enumerate(encoders):
        encoder.reset(rows(base, rank), 50)

    def write(model, version):
        directory = root / f"delta-v{version:08d}"
        directory.mkdir()
        paths = [directory / f"rank_{rank:05d}.bin" for rank in range(2)]
        for rank, (encoder, path) in enumerate(zip(encoders, paths)):
            path.write_bytes(encoder.encode(rows(model, rank), version, final=rank == 1).to_bytes())
        return paths

    paths = write(other, 51)
    assert sync.push(ShardDeltas(paths, []), 51, [client]) == []
    assert client.weight_hashes() == tensor_hashes(_named(other)) and client.get_weight_version() == 51
    assert not any(p.exists() for p in paths) and sync.shard_base == 51

    paths = write(base, 52)
    damaged = bytearray(paths[1].read_bytes())
    damaged[-1] ^= 0xFF
    paths[1].write_bytes(bytes(damaged))
    with pytest.raises(IncompleteSync, match="checksum mismatch") as failed:
        sync.push(ShardDeltas(paths, []), 52, [client])
    assert failed.value.directory == root / "v00000052" and sync.form(52) == SyncForm(directory=root / "v00000052")
    assert client.get_weight_version() == 51  # rank 0's rows are in, the version is not
    assert client.generate(PROMPTS[:1], GREEDY)[0].tokens  # resumed
    assert sync.push(save_weights(base, failed.value.directory), 52, [client]) == []
    assert client.weight_hashes() == tensor_hashes(_named(base)) and sync.shard_base == 52


# ---------------------------------------------------------------- the client against broken servers
class _CannedServer(socketserver.ThreadingTCPServer):
    """Answers every connection with ``reply`` bytes (None: accepts and never answers)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, reply: bytes | None):
        self.reply, self.release = reply, threading.Event()
        super().__init__(("127.0.0.1", 0), _CannedHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def close(self):
        self.release.set()
        self.shutdown()
        self.server_close()


class _CannedHandler(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.recv(65536)
        if self.server.reply is None:  # hold the connection open, silent
            self.server.release.wait(60)
            return
        self.request.sendall(self.server.reply)


def _http(status: str, body: bytes) -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


def test_the_client_times_out_on_a_server_that_never_answers():
    hung = _CannedServer(None)
    try:
        client = HTTPEngine(hung.url, timeout_s=0.3, retries=1, retry_backoff_s=0.01)
        with pytest.raises(EngineUnavailable, match=r"POST /generate: no answer within 0.3 s"):
            client.generate([[1, 2]], GREEDY)
        assert (client.stats["calls"], client.stats["failures"], client.stats["retries"]) == (2, 2, 1)
        health = client.health()
        assert health["ok"] is False and "no answer" in health["error"]
    finally:
        hung.close()


@pytest.mark.parametrize("reply,match", [
    (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "BadStatusLine"),
    (_http("200 OK", b'{"hello": 1}'), "answered garbage: not a /generate answer"),
    (_http("200 OK", b"<html>hi</html>"), "answered garbage \\(not JSON\\)"),
    (_http("200 OK", b'[{"output_ids": [1]}]'), "answered garbage"),
    (_http("503 Service Unavailable", b'{"error": "overloaded"}'), "answered 503: overloaded"),
    (b"", "RemoteDisconnected"),
])
def test_the_client_raises_on_garbage(reply, match):
    canned = _CannedServer(reply)
    try:
        client = HTTPEngine(canned.url, timeout_s=5, retries=0)
        with pytest.raises(EngineUnavailable, match=match):
            client.generate([[1, 2]], GREEDY)
        assert client.stats["failures"] >= 1
    finally:
        canned.close()


def test_the_client_on_a_refused_connection():
    client = HTTPEngine(f"http://127.0.0.1:{free_port()}", timeout_s=5, retries=2, retry_backoff_s=0.01)
    with pytest.raises(EngineUnavailable, match="ConnectionRefusedError"):
        client.generate([[1]], GREEDY)
    assert client.stats["retries"] == 2
    assert client.health()["ok"] is False
