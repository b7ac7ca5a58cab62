"""Starting an engine server under the fleet's supervisor (orthon.rl.fleet.EngineServer, without Ray):
the port race between choosing a free port and the server binding it."""
from __future__ import annotations

import socket
import sys
import threading
from pathlib import Path

import pytest

import orthon.rl.fleet as fleet
from orthon.core.net import wait_until_healthy

sys.path.insert(0, str(Path(__file__).parent))
from server_support import tiny_weights  # noqa: E402


@pytest.fixture
def garbage_server():
    """A program on a loopback port that answers every connection with bytes that are not HTTP."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def serve():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.sendall(b"\x00\x00@\x00\x00\xfe\x00\x00?\r\n\r\n")
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield listener.getsockname()[1]
    stop.set()
    thread.join(5)
    listener.close()


def test_a_port_answering_in_another_protocol_is_not_healthy_yet(garbage_server):
    url = f"http://127.0.0.1:{garbage_server}/health"
    with pytest.raises(TimeoutError, match="not healthy after"):  # polled until the deadline, not raised through
        wait_until_healthy(url, timeout_s=0.6, interval_s=0.05)
    with pytest.raises(RuntimeError, match="exited before it became healthy"):
        wait_until_healthy(url, timeout_s=5, alive=lambda: False)


def _ports(monkeypatch, first: int) -> list[int]:
    """free_port returns ``first``, then free ports; returns the list of ports handed out."""
    given, real = [], fleet.free_port

    def port(host):
        given.append(first if not given else real(host))
        return given[-1]

    monkeypatch.setattr(fleet, "free_port", port)
    return given


@pytest.mark.usefixtures("one_thread")
def test_a_server_whose_port_was_taken_starts_on_another(tmp_path, monkeypatch, garbage_server):
    # The port is free when chosen, then another program binds it before the server does.
    given = _ports(monkeypatch, garbage_server)
    server = fleet.EngineServer(str(tiny_weights(tmp_path / "weights")), str(tmp_path / "logs"), startup_timeout_s=120)
    try:
        assert len(given) == 2 and server.url() == f"http://127.0.0.1:{given[1]}"
        assert "address already in use" in (tmp_path / "logs" / f"engine_{given[0]}.log").read_text()
    finally:
        server.stop()


@pytest.mark.usefixtures("one_thread")
def test_a_server_that_fails_for_another_reason_is_not_retried(tmp_path, monkeypatch):
    given = _ports(monkeypatch, fleet.free_port())
    with pytest.raises(RuntimeError, match=r"exited before it became healthy; the end of .*engine_\d+\.log"):
        fleet.EngineServer(str(tmp_path / "no_weights"), str(tmp_path / "logs"), startup_timeout_s=120)
    assert len(given) == 1
