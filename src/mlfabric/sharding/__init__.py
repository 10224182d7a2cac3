"""Sharded parameter servers (the model partitioned over several hosts):
which bytes of the model each shard keeps (`partition`), without I/O."""

from .partition import DEFAULT_CHUNK_BYTES, Partition, Piece, partition

__all__ = ["DEFAULT_CHUNK_BYTES", "Partition", "Piece", "partition"]
