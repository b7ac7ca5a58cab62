"""`orthon serve` and its client: SGLang's API shapes, parity with the in-process engine, continuous
batching across concurrent callers, weight updates with versions, bad input answered with 400s while
the server keeps serving, clients that time out instead of hanging, and the real sglang-router
keeping a routing key on one engine."""
import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from orthon.core.errors import EngineUnavailable
from orthon.core.net import free_port, wait_until_healthy
from orthon.engine.client import HTTPEngine
from orthon.engine.in_process import InProcessEngine
from orthon.engine.sampling import SamplingParams
from orthon.pretrain import GLMForCausalLM, ModelConfig
from orthon.pretrain.weights import load_weights, save_weights
from pretrain_support import MODEL

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def _start(weights, extra=()):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "orthon.launch.cli", "serve", str(weights), "--port", str(port), *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(url + "/health", 120, alive=lambda: proc.poll() is None)
    return proc, url


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    torch.manual_seed(0)
    save_weights(GLMForCausalLM(ModelConfig(**{**MODEL, "vocab_size": 512})), root / "v0")
    torch.manual_seed(1)
    save_weights(GLMForCausalLM(ModelConfig(**{**MODEL, "vocab_size": 512})), root / "v1")
    proc, url = _start(root / "v0")
    yield root, url
    proc.terminate()
    proc.wait(30)


def _post(url, path, body=None, data=None, headers=None):
    return requests.post(url + path, json=body, data=data, headers=headers, timeout=60)


def test_generate_matches_the_in_process_engine(served):
    root, url = served
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12]]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=())
    local = InProcessEngine(load_weights(root / "v0")).generate(prompts, params)
    remote = HTTPEngine(url).generate(prompts, params)
    for a, b in zip(local, remote):
        assert a.tokens == b.tokens and b.finish_reason == "length"
        torch.testing.assert_close(a.log_probs, b.log_probs, rtol=0, atol=1e-6)
    # SGLang's answer shape, one prompt.
    answer = _post(url, "/generate", {"input_ids": [5, 6], "return_logprob": True,
                                      "sampling_params": {"max_new_tokens": 3, "temperature": 0, "top_k": -1}}).json()
    assert len(answer["output_ids"]) == 3 and answer["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    assert answer["meta_info"]["prompt_tokens"] == 2 and answer["meta_info"]["completion_tokens"] == 3
    assert [t for _, t, _ in answer["meta_info"]["output_token_logprobs"]] == answer["output_ids"]
    # A batch of input_ids answers a list.
    batch = _post(url, "/generate", {"input_ids": [[5], [6, 7]], "sampling_params": {"max_new_tokens": 2}}).json()
    assert isinstance(batch, list) and len(batch) == 2


def test_concurrent_callers_share_batches(served):
    _, url = served
    before = requests.get(url + "/get_server_info", timeout=10).json()["batching"]
    engine = HTTPEngine(url, concurrency=16)
    results = engine.generate([[5 + i, 6] for i in range(16)], SamplingParams(max_new_tokens=8, seed=3))
    after = requests.get(url + "/get_server_info", timeout=10).json()["batching"]
    assert all(r.finish_reason in ("length", "stop") and len(r.tokens) >= 1 for r in results)
    assert after["requests"] - before["requests"] == 16
    assert after["batches"] - before["batches"] < 16 and after["largest_batch"] > 1


@pytest.mark.parametrize("body,data,status,message", [
    (None, b"{not json", 400, "malformed JSON"),
    ({"sampling_params": {}}, None, 400, "input_ids or text"),
    ({"input_ids": [5, 100000]}, None, 400, "outside the vocabulary"),
    ({"input_ids": [5], "sampling_params": {"max_new_tokens": -1}}, None, 400, "max_new_tokens"),
    ({"input_ids": ["a"]}, None, 400, "list of integers"),
    ({"text": "hello"}, None, 400, "no tokenizer"),
    (None, b'{"input_ids": [' + b"1," * (5 << 20) + b"1]}", 413, "over the limit"),
])
def test_bad_input_is_a_400_and_the_server_goes_on(served, body, data, status, message):
    _, url = served
    answer = _post(url, "/generate", body, data=data, headers={"Content-Type": "application/json"} if data else None)
    assert answer.status_code == status and message in answer.json()["error"]
    assert _post(url, "/generate", {"input_ids": [5], "sampling_params": {"max_new_tokens": 1}}).status_code == 200


def test_weight_updates_change_outputs_and_versions(served):
    root, url = served
    engine = HTTPEngine(url)
    params = SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=())
    before = engine.generate([[5, 6, 7]], params)[0]
    assert engine.update_weights(str(root / "v1"), version=7) == 7
    after = engine.generate([[5, 6, 7]], params)[0]
    assert after.weight_version == 7 and after.tokens != before.tokens or not torch.equal(after.log_probs, before.log_probs)
    # Every update changes the version; SGLang's string versions are taken too.
    assert _post(url, "/update_weights_from_disk", {"model_path": str(root / "v0"), "weight_version": "8"}).json()["weight_version"] == 8
    assert engine.update_weights(str(root / "v0")) == 9
    bad = _post(url, "/update_weights_from_disk", {"model_path": str(root / "nosuch")})
    assert bad.status_code == 400 and "nosuch" in bad.json()["error"]
    assert engine.health()["weight_version"] == 9


def test_delta_for_the_wrong_base_is_refused(served):
    from orthon.engine.delta import DeltaEncoder

    root, url = served
    engine = HTTPEngine(url)
    version = engine.update_weights(str(root / "v0"))
    model = load_weights(root / "v0")
    encoder = DeltaEncoder()
    encoder.reset(list(model.state_dict().items()), version + 5)  # the sender believes another base
    with torch.no_grad():
        model.lm_head.weight.add_(0.01)
    payload = encoder.encode(list(model.state_dict().items()), version + 6)
    answer = _post(url, "/orthon/update_weights_from_delta", data=payload.to_bytes(),
                   headers={"Content-Type": "application/octet-stream"})
    assert answer.status_code == 409 and f"from weight version {version + 5}" in answer.json()["error"]
    assert engine.health()["weight_version"] == version
    # The right base goes through, and the engine then holds the trainer's bytes exactly.
    encoder.reset(list(load_weights(root / "v0").state_dict().items()), version)
    assert engine.update_weights(encoder.encode(list(model.state_dict().items()), version + 1)) == version + 1
    hashes = engine.weight_hashes()
    from orthon.engine.tensor_bytes import tensor_hashes

    assert hashes == tensor_hashes(list(model.state_dict().items()))


def test_pause_holds_requests_and_abort_answers_them(served):
    _, url = served
    engine = HTTPEngine(url, timeout_s=30)
    engine.pause()
    waiting = ThreadPoolExecutor(1).submit(engine.generate, [[5, 6]], SamplingParams(max_new_tokens=2))
    threading.Event().wait(0.5)
    assert not waiting.done()
    engine.pause(abort_waiting=True)  # aborts what waits
    result = waiting.result(timeout=10)[0]
    assert result.finish_reason == "abort" and result.tokens == []
    engine.resume()
    assert engine.generate([[5]], SamplingParams(max_new_tokens=1))[0].finish_reason in ("length", "stop")


def test_client_times_out_on_a_hanging_server_and_on_garbage():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()  # accepts connections and never answers
    hang = HTTPEngine(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout_s=0.5)
    with pytest.raises(EngineUnavailable, match="Timeout"):
        hang.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    listener.close()

    garbage = socket.socket()
    garbage.bind(("127.0.0.1", 0))
    garbage.listen()

    def answer_garbage():
        for _ in range(2):
            conn, _ = garbage.accept()
            conn.recv(65536)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nConnection: close\r\n\r\ngarbage")
            conn.close()

    threading.Thread(target=answer_garbage, daemon=True).start()
    client = HTTPEngine(f"http://127.0.0.1:{garbage.getsockname()[1]}", timeout_s=5)
    with pytest.raises(EngineUnavailable, match="not JSON"):
        client.generate([[1, 2]], SamplingParams(max_new_tokens=1))
    garbage.close()
    with pytest.raises(EngineUnavailable):
        HTTPEngine(f"http://127.0.0.1:{free_port()}", timeout_s=2).health()  # nothing listens


def test_router_keeps_a_routing_key_on_one_engine(served):
    pytest.importorskip("sglang_router")
    from orthon.engine.router import Router

    root, url = served
    second, url2 = _start(root / "v0")
    router = None
    try:
        router = Router.start([url, url2], free_port())
        client = HTTPEngine(router.url)

        def counts():
            return [requests.get(u + "/get_server_info", timeout=10).json()["batching"]["routing_keys"] for u in (url, url2)]

        client.generate([[5, 6]] * 20, SamplingParams(max_new_tokens=1), routing_keys=["session-a"] * 20)
        keys = [c.get("session-a", 0) for c in counts()]
        assert sorted(keys) == [0, 20]  # all on one engine
        # Many keys spread over both engines (random assignment of new keys).
        client.generate([[5]] * 40, SamplingParams(max_new_tokens=1), routing_keys=[f"k{i}" for i in range(40)])
        spread = [sum(v for k, v in c.items() if k.startswith("k")) for c in counts()]
        assert min(spread) > 0 and sum(spread) == 40
        router.remove_worker(url2)
        assert set(router.workers()) == {url}
        router.add_worker(url2)
        assert set(router.workers()) == {url, url2}
    finally:
        if router is not None:
            router.stop()
        second.terminate()
        second.wait(30)
