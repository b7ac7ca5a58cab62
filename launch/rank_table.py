"""The HCCL rank table of Ascend 910B (Atlas A2) nodes, from a host list.

A host list has one node a line: its address (the rank table's ``server_id``, and msrun's master
address for the first line) and then the IP of each of its NPUs' network ports, in device order (what
``hccn_tool -i N -ip -g`` prints on that node for N = 0, 1, ...). ``#`` starts a comment. Example:

    10.0.0.1  192.168.100.1 192.168.101.1 192.168.102.1 192.168.103.1
    10.0.0.2  192.168.100.2 192.168.101.2 192.168.102.2 192.168.103.2

The table (HCCL's documented format, version 1.0) lists, per server, each device's physical id, NIC IP
and global rank id (node i, device j -> rank i x devices + j), every value a string:

    {"version": "1.0", "server_count": "2", "status": "completed",
     "server_list": [{"server_id": "10.0.0.1", "device": [{"device_id": "0", "device_ip": "192.168.100.1",
                                                            "rank_id": "0"}, ...]}, ...]}
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from orthon.core.errors import ConfigError
from orthon.launch.launchers import check_host

RANK_TABLE_VERSION = "1.0"
MAX_DEVICES_PER_NODE = 16  # 8 on an Atlas 800T A2; 16 on the A2 Box16


@dataclass(frozen=True)
class Host:
    server_id: str
    device_ips: tuple[str, ...]
    line: int  # in the host list, for errors


def parse_host_list(text: str, source: str = "host list") -> list[Host]:
    """The nodes of a host list (see the module doc); a malformed address names its line."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), start=1):
        words = raw.split("#", 1)[0].split()
        if not words:
            continue
        server = check_host(words[0], f"{source}, line {number}")
        ips = []
        for word in words[1:]:
            try:
                ips.append(str(ipaddress.ip_address(word)))
            except ValueError:
                raise ConfigError(f"{source}, line {number}: device IP {word!r} is not an IP address") from None
        hosts.append(Host(server, tuple(ips), number))
    return hosts


def read_host_list(path) -> list[Host]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"host list {path}: cannot read it ({exc.strerror or exc})") from None
    return parse_host_list(text, f"host list {path}")


def check_hosts(hosts: list[Host], devices_per_node: int | None = None) -> int:
    """The number of devices each node contributes, after checking the list: not empty, no node twice, no
    device IP twice, the same device count on every node (``devices_per_node`` when given), IPs on every
    node when there is more than one (HCCL needs them to connect the nodes)."""
    if not hosts:
        raise ConfigError("host list: empty; give one line per node: ADDRESS DEVICE_IP ...")
    seen: dict[str, int] = {}
    for host in hosts:
        if host.server_id in seen:
            raise ConfigError(f"host list: {host.server_id} appears twice (lines {seen[host.server_id]} and "
                              f"{host.line}); each node once")
        seen[host.server_id] = host.line
    owner: dict[str, str] = {}
    for host in hosts:
        for ip in host.device_ips:
            if ip in owner:
                raise ConfigError(f"host list: device IP {ip} appears twice ({owner[ip]} and {host.server_id}, "
                                  f"line {host.line}); each NPU port has its own address")
            owner[ip] = host.server_id
    counts = {len(h.device_ips) for h in hosts}
    if len(hosts) > 1 and 0 in counts:
        bare = next(h for h in hosts if not h.device_ips)
        raise ConfigError(f"host list, line {bare.line}: {bare.server_id} lists no device IPs; a rank table for "
                          f"{len(hosts)} nodes needs each NPU's IP (hccn_tool -i N -ip -g on that node)")
    if len(counts) > 1:
        raise ConfigError("host list: nodes list different numbers of device IPs ("
                          + ", ".join(f"{h.server_id}: {len(h.device_ips)}" for h in hosts) + "); every node must "
                          "start the same number of workers")
    listed = counts.pop()
    if devices_per_node is None:
        if not listed:
            raise ConfigError("host list: no device IPs, so the devices per node are unknown; give "
                              "--local-worker-num or list the NPU IPs")
        devices_per_node = listed
    if listed and listed != devices_per_node:
        raise ConfigError(f"local-worker-num: {devices_per_node} workers a node, but the host list gives "
                          f"{listed} device IPs a node")
    if not 1 <= devices_per_node <= MAX_DEVICES_PER_NODE:
        raise ConfigError(f"local-worker-num: {devices_per_node} devices a node; a 910B node has 1.."
                          f"{MAX_DEVICES_PER_NODE}")
    return devices_per_node


def rank_table(hosts: list[Host], devices_per_node: int | None = None) -> dict:
    """The HCCL rank table (version 1.0) of ``hosts``: devices 0..n-1 on every node, ranks numbered node by
    node, as msrun numbers them with --node_rank."""
    devices_per_node = check_hosts(hosts, devices_per_node)
    servers = []
    for node, host in enumerate(hosts):
        devices = []
        for device in range(devices_per_node):
            entry = {"device_id": str(device)}
            if host.device_ips:
                entry["device_ip"] = host.device_ips[device]
            entry["rank_id"] = str(node * devices_per_node + device)
            devices.append(entry)
        servers.append({"server_id": host.server_id, "device": devices})
    return {"version": RANK_TABLE_VERSION, "server_count": str(len(hosts)), "server_list": servers,
            "status": "completed"}
