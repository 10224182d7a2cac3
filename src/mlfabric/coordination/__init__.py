"""Several controllers for one job (issue 34): which controller plans which
server shard, held in etcd under leases (`ShardLeases`), by the rules in
`ownership`, through a small asyncio client of etcd's JSON gateway (`etcd`)."""

from .etcd import EtcdClient, EtcdError
from .leases import ShardLeases

__all__ = ["EtcdClient", "EtcdError", "ShardLeases"]
