"""Prefix-affinity routing across engine replicas, as a Ray Serve request router.

A replica keeps the KV of the prompts it served (docs/serving.md, "rows plus copy-in"), so a
request whose prompt starts like an earlier one is cheapest on the replica that served that one.
This router remembers, per prefix key (specdec.serve.relay.prefix_key), the replica a request of
that key was last sent to, and sends the next one there; every other request (a new key, a key
whose replica is gone, a request with no prompt) goes to the least loaded replica. Affinity gives
way to load when the holder has more than `imbalance_slack` requests beyond the least loaded
replica, or is full (Serve's `max_ongoing_requests`): then the least loaded replica takes it and
becomes the key's holder.

Load is Serve's own count of requests ongoing at each replica (its queue-length cache; a replica
with no fresh entry is asked first). Serve does the sending, the retries when a replica refuses,
and drops dead replicas. What this router does not know: whether the holder still has the prefix
in KV (a replica keeps `--max-batch` rows, least recently freed reused first), nor what another
ingress replica's router remembers (each has its own table; with one ingress, the default, there
is one table).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from specdec.serve.relay import RelayedCall

PROBE_S = 0.5  # how long to wait for a replica's queue length


class PrefixAffinityRouter(RequestRouter):
    """Routes a request to its prefix key's holder unless that is imbalanced; else least loaded."""

    def initialize_state(self, imbalance_slack: int = 4, max_keys: int = 100_000, **kwargs):
        self._slack = imbalance_slack
        self._max_keys = max_keys
        self._holders: OrderedDict[str, ReplicaID] = OrderedDict()  # LRU: prefix key -> replica

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        """Ranks, most preferred first; Serve sends to the least loaded replica of the first rank
        that has room, so a full holder or a rank that refuses falls through to the next."""
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # all replicas tried: back off
        loads = await self._loads(candidate_replicas)
        holder = self._holder(_key(pending_request), candidate_replicas)
        if holder is None or loads[holder.replica_id] > min(loads.values()) + self._slack:
            return _by_load(candidate_replicas, loads)
        return [[holder]] + _by_load([r for r in candidate_replicas if r is not holder], loads)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        key = _key(pending_request)
        if key is None:
            return
        self._holders[key] = replica_id
        self._holders.move_to_end(key)
        while len(self._holders) > self._max_keys:
            self._holders.popitem(last=False)

    def _holder(self, key: str | None, candidates: list[RunningReplica]) -> RunningReplica | None:
        rid = self._holders.get(key) if key is not None else None
        return next((r for r in candidates if r.replica_id == rid), None)

    async def _loads(self, replicas: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Requests ongoing at each replica, from Serve's cache; a replica without a fresh entry
        (idle for a while) is asked, since Serve itself would pick among the cached ones only.
        One that does not answer counts as full."""
        cache = self.replica_queue_len_cache
        await asyncio.gather(*(self._probe(r) for r in replicas if cache.get(r.replica_id) is None))
        return {r.replica_id: r.max_ongoing_requests if (n := cache.get(r.replica_id)) is None else n
                for r in replicas}

    async def _probe(self, replica: RunningReplica) -> None:
        try:
            n = await asyncio.wait_for(replica.get_queue_len(deadline_s=PROBE_S), PROBE_S)
        except Exception:  # noqa: BLE001 - dead, restarting or slow: Serve deals with it
            return
        self.on_new_queue_len_info(replica.replica_id, n)


def _by_load(replicas: list[RunningReplica], loads: dict[ReplicaID, int]) -> list[list[RunningReplica]]:
    """The replicas in ranks of equal load, least loaded first."""
    ranks: dict[int, list[RunningReplica]] = {}
    for r in sorted(replicas, key=lambda r: loads[r.replica_id]):
        ranks.setdefault(loads[r.replica_id], []).append(r)
    return list(ranks.values())


def _key(pending_request: PendingRequest | None) -> str | None:
    if pending_request is None or not pending_request.args:
        return None
    call = pending_request.args[0]
    return call.prefix_key if isinstance(call, RelayedCall) else None
