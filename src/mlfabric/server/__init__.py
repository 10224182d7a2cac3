"""The parameter server: the asyncio server (`server`), the model store and its
kernels' use (`store`), pulls that wait for a version (`pulls`), checkpoints
(`checkpoint`, `checkpointer`) and the `mlfabric server` command (`cli`)."""

from .server import ParameterServer

__all__ = ["ParameterServer"]
