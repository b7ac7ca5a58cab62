"""The real sglang-router (--policy manual) in front of two `orthon serve` processes: every request with
one routing key lands on one engine (counted by each server's /get_server_info), different keys spread
over both and each stays where it first landed, workers are removed and added through the router's
/workers API, a refused request comes back rejected through it, and a router whose workers never come
up fails with a timeout that says so."""
import pytest

from orthon.core.errors import ConfigError
from orthon.core.net import free_port, get_json
from orthon.engine.client import HTTPEngine
from orthon.engine.sampling import SamplingParams
from server_support import ServerProcess, tiny_weights

pytest.importorskip("sglang_router")

from orthon.engine.router import Router  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SEEDED = SamplingParams(max_new_tokens=2, temperature=1.0, seed=5, stop_token_ids=())


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("router")
    weights = tiny_weights(root / "weights")
    started = [ServerProcess(weights, root / f"engine{i}.log") for i in range(2)]
    for server in started:  # both load at once
        server.wait()
    yield started
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def router(servers, tmp_path_factory):
    started = Router.start([s.url for s in servers], free_port(), policy="manual", timeout_s=60,
                           log_path=tmp_path_factory.mktemp("router-log") / "router.log")
    yield started
    started.stop()


def _seen(servers) -> list[int]:
    """Requests each server has taken so far."""
    return [get_json(s.url + "/get_server_info")["batching"]["requests"] for s in servers]


def _landed(servers, before) -> list[int]:
    return [after - b for after, b in zip(_seen(servers), before)]


def test_router_lists_its_workers(servers, router):
    assert sorted(router.workers()) == sorted(s.url for s in servers)
    assert sorted(router.workers(healthy_only=True)) == sorted(s.url for s in servers)


def test_one_routing_key_lands_on_one_engine(servers, router):
    client = HTTPEngine(router.url)
    before = _seen(servers)
    # Twenty separate requests (each its own seed), all of session "agent-7".
    results = client.generate([[5, 6, 7]] * 20, SEEDED, routing_keys=["agent-7"] * 20)
    assert [r.finish_reason for r in results] == ["length"] * 20 and [r.seed for r in results] == list(range(5, 25))
    assert sorted(_landed(servers, before)) == [0, 20]


def test_different_keys_spread_and_each_stays_put(servers, router):
    client = HTTPEngine(router.url)
    home = {}
    for key in (f"session-{i}" for i in range(16)):
        before = _seen(servers)
        client.generate([[9, 8]], SEEDED, routing_keys=[key])
        home[key] = _landed(servers, before).index(1)
    assert set(home.values()) == {0, 1}  # 16 keys all on one of two engines: p = 2^-15 if spread at random
    before = _seen(servers)
    keys = list(home)
    client.generate([[9, 8]] * 16, SEEDED, routing_keys=keys)
    expected = [sum(1 for k in keys if home[k] == i) for i in range(2)]
    assert _landed(servers, before) == expected


def test_a_refused_request_comes_back_rejected_through_the_router(router):
    result = HTTPEngine(router.url).generate([[5, 320]], SEEDED, routing_keys=["bad"])[0]
    assert result.finish_reason == "rejected" and "token id 320 is outside the vocabulary" in result.error


def test_remove_and_add_workers(servers, router):
    kept, removed = servers[0].url, servers[1].url
    router.remove_worker(removed)
    assert router.workers() == [kept]
    client = HTTPEngine(router.url)
    before = _seen(servers)
    client.generate([[3, 4]] * 8, SEEDED, routing_keys=[f"after-removal-{i}" for i in range(8)])
    assert _landed(servers, before) == [8, 0]
    router.add_worker(removed)
    assert sorted(router.workers(healthy_only=True)) == sorted([kept, removed])
    before = _seen(servers)
    client.generate([[3, 4]] * 8, SEEDED, routing_keys=[f"after-removal-{i}" for i in range(8)])
    assert _landed(servers, before) == [8, 0]  # sessions stay on the engine that holds them


def test_a_router_whose_worker_never_answers_times_out(tmp_path):
    with pytest.raises(ConfigError, match="policy"):
        Router.start([], free_port(), policy="fastest")
    with pytest.raises(TimeoutError, match=r"did not list \['http://127.0.0.1:\d+'\] as healthy within 3 s"):
        Router.start([f"http://127.0.0.1:{free_port()}"], free_port(), timeout_s=3, log_path=tmp_path / "r.log")


def test_a_router_whose_metrics_port_was_taken_starts_on_another(tmp_path, monkeypatch):
    """The metrics port is free when chosen, but another process may bind it before the router does: the
    router exits ("Address already in use"), and the start is retried on a new port, the running router's
    log tail holding only its own output; a port taken at every attempt fails after ``attempts`` starts."""
    import socket

    import orthon.engine.router as router_module

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1], free_port()])
    monkeypatch.setattr(router_module, "free_port", lambda host="127.0.0.1": next(ports))
    log = tmp_path / "r.log"
    try:
        started = Router.start([], free_port(), timeout_s=60, log_path=log)
        try:
            assert started.workers() == []
            assert "already in use" in log.read_text().lower()  # the first start's output, before the retry
            assert "already in use" not in started._tail().lower()  # the running router's own output
        finally:
            started.stop()
        ports = iter([taken.getsockname()[1]] * 3)
        with pytest.raises(router_module.EngineUnavailable, match="(?i)address already in use"):
            Router.start([], free_port(), timeout_s=60, log_path=tmp_path / "r2.log", attempts=3)
        assert next(ports, None) is None  # three starts, each on the taken port
    finally:
        taken.close()
