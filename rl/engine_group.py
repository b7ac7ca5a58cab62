"""A weight-update group: one trainer process (the group's rank 0, which broadcasts) and every engine
(ranks 1..N), as SGLang's init_weights_update_group forms it. Formed on first use and again whenever the
engines changed (one restarted, one replaced); closed after a failure, since a member may be gone."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from orthon.core.net import free_port
from orthon.engine.weight_transfer import open_update_group

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


def together(clients, remote, local) -> None:
    """``remote(client)`` on every engine while this process runs ``local()`` (a collective)."""
    with ThreadPoolExecutor(max(1, len(clients))) as pool:
        calls = [pool.submit(remote, c) for c in clients]
        local()
        for call in calls:
            call.result()


class EngineGroup:
    """The update group named ``name`` of this process and the engines it was last formed with, meeting at
    ``address`` (this process's: 127.0.0.1 on one machine, its node's address across several)."""

    def __init__(self, name: str = DEFAULT_GROUP, address: str = "127.0.0.1"):
        self.name, self.address = name, address
        self.group = None
        self.members: tuple[str, ...] = ()

    def formed(self, clients):
        """The group of this process and ``clients``' engines (formed again when they changed)."""
        members = tuple(c.url for c in clients)
        if self.group is not None and members == self.members:
            return self.group
        self.close()
        port, world = free_port(self.address), len(clients) + 1
        opened = []
        together(clients, lambda c: c.init_weights_update_group(self.address, port, members.index(c.url) + 1, world,
                                                                group_name=self.name),
                 lambda: opened.append(open_update_group(self.address, port, 0, world)))
        self.group, self.members = opened[0], members
        return self.group

    def close(self) -> None:
        """After a failure (a member may be gone): the next use forms the group again."""
        if self.group is not None:
            self.group.close()
        self.group, self.members = None, ()
