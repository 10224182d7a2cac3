"""Keeping a replica of the server in step, on every side: the replica process
(`replica`, `sequencer`), chain replication (`chain`), measured divergence
(`divergence_sampling`), the divergence bound (`divergence`) and the
controller's rule that enforces it (`gate`), failover and promotion
(`failover`, `promote_cli`). The worker's side is `mlfabric.client.replica_feed`."""

from .replica import ReplicaServer

__all__ = ["ReplicaServer"]
