"""The distributed weight-sync path from a pipelined trainer: one weight-update group per pipeline stage
(SPEC; slime's per-stage groups). Each stage's leader (its lowest rank) gathers its stage's parts from
that stage's ranks only and broadcasts them to the engines over its own group while the other stages do
the same: the stages' bytes travel side by side, and no rank gathers, or waits on, another stage's
weights (through one group every part would pass rank 0 in turn).

Rank 0, which runs the engine fleet, pauses the engines, hands every rank their URLs (``run_stages``,
called by every rank at once), and once every stage has reported flushes the engines' caches and resumes
them. A failure on any rank fails the whole sync: rank 0 raises it (orthon.rl.weight_sync turns it into
IncompleteSync, after which the ranks write the version's directory for a full copy)."""
from __future__ import annotations

from orthon.core import distributed
from orthon.engine.tensor_bytes import tensor_hashes
from orthon.engine.weight_transfer import TensorMeta, broadcast_tensors
from orthon.pretrain.gathered_weights import drain_on_error
from orthon.rl.engine_group import EngineGroup, together
from orthon.rl.weight_sync import _named


class StageSender:
    """A stage leader's side: its stage's group with the engines, kept while they stay the same."""

    def __init__(self, stage: int, address: str = "127.0.0.1"):
        self.group = EngineGroup(f"orthon_pipeline_stage_{stage}", address)

    def send(self, loaders: list, clients, version: int, check: bool) -> dict[str, str]:
        """Each part, as the stage's ranks gather it, broadcast to the engines (every loader is called even
        when sending fails: the stage's other ranks wait in their gathers). The hashes of what was sent
        when ``check``."""
        hashes: dict[str, str] = {}
        name = self.group.name

        def each(loaders):
            group = self.group.formed(clients)
            for load in loaders:
                named = _named(load())
                if check:
                    hashes.update(tensor_hashes(named))
                metas = [TensorMeta.of(n, t) for n, t in named]
                together(clients, lambda c: c.update_weights_from_distributed(metas, version, group_name=name,
                                                                            flush_cache=False),
                         lambda: broadcast_tensors(group, named))

        try:
            drain_on_error(loaders, each)
        except Exception:
            self.group.close()
            raise
        return hashes


def run_stages(stage, sender: StageSender | None, version: int, client_factory, check: bool,
               urls: list[str] | None) -> tuple[int, list[str], dict[str, str]]:
    """Every rank at once: ``stage`` is this rank's (``stage``, ``loaders``, ``leader``); ``sender`` the
    leader's; ``urls`` the engines' on rank 0 (None elsewhere). On rank 0: (parts sent by every stage, each
    failing rank's reason, the hashes sent when ``check``); elsewhere (0, [], {})."""
    urls = distributed.broadcast_object(urls)
    sent, error, hashes = 0, None, {}
    try:
        if stage.leader and urls:
            hashes = sender.send(stage.loaders, [client_factory(u) for u in urls], version, check)
            sent = len(stage.loaders)
        else:  # the stage's other ranks (or nothing to send to): their pieces to the leader's gathers
            for load in stage.loaders:
                load()
    except Exception as exc:  # reported, not raised: every rank must reach the gather below
        error = f"rank {distributed.rank()} (pipeline stage {stage.stage}): {type(exc).__name__}: {exc}"
    reports = distributed.gather_object((sent, error, hashes))
    if reports is None:
        return 0, [], {}
    want: dict[str, str] = {}
    for _, _, h in reports:
        want.update(h)
    return sum(r[0] for r in reports), [r[1] for r in reports if r[1]], want
