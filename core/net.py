"""Small network helpers for services orthon starts itself (engine servers, the router)."""
from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request


NETWORKS = ("auto", "local", "node")


def service_host(network: str) -> str:
    """The address a service this process starts listens on and is reached at: 127.0.0.1 where every
    process of the run is on one machine ("local"); this node's address, as Ray knows it, where they span
    several ("node"); "auto": node where this process belongs to a Ray cluster of several live nodes."""
    if network not in NETWORKS:
        raise ValueError(f"network: expected one of {', '.join(NETWORKS)}, got {network!r}")
    if network == "local" or network == "auto" and not _in_multi_node_ray():
        return "127.0.0.1"
    import ray

    return ray.util.get_node_ip_address()


def _in_multi_node_ray() -> bool:
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized() and sum(1 for node in ray.nodes() if node.get("Alive")) > 1


def interface_towards(address: str) -> str:
    """This machine's address on the route to ``address`` (no packet is sent: a UDP socket's connect only
    picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return s.getsockname()[0]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def get_json(url: str, timeout_s: float = 5.0) -> dict:
    """GET ``url`` and parse its JSON body; raises OSError (incl. timeouts) or ValueError."""
    with urllib.request.urlopen(url, timeout=timeout_s) as answer:
        return json.loads(answer.read() or b"{}")


def wait_until_healthy(url: str, timeout_s: float, alive=lambda: True, interval_s: float = 0.2) -> None:
    """Poll ``url`` until it answers 200; TimeoutError after ``timeout_s``; RuntimeError as soon as
    ``alive()`` says the process behind it is gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not alive():
            raise RuntimeError(f"{url}: the process serving it exited before it became healthy")
        try:
            with urllib.request.urlopen(url, timeout=min(5.0, timeout_s)) as answer:
                if answer.status == 200:
                    return
        except (OSError, urllib.error.URLError, http.client.HTTPException):
            pass  # not up yet, or (between free_port and the server's bind) another program answering there
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}: not healthy after {timeout_s:.0f}s")
        time.sleep(interval_s)
