"""Measured divergence: the server pulls the replica's model and compares."""

from __future__ import annotations

import asyncio

import numpy as np

from mlfabric.replication.divergence_sampling import ReplicaSampler
from mlfabric.replication.replica import ReplicaServer
from mlfabric.runtime.metrics import ServerMetrics
from mlfabric.server.store import ParameterStore
from mlfabric.wire.protocol import Push

from support import JOB, TOKEN, RawClient, Reference, ServerThread, make_model, random_update


def test_sampled_divergence_is_the_true_one_and_zero_once_caught_up():
    model = make_model()
    updates = [random_update(model, seed) for seed in range(4)]
    replica_ep = ReplicaServer(ParameterStore(model, momentum=0.9), job=JOB, token=TOKEN,
                               metrics=ServerMetrics())
    with ServerThread(ParameterStore(model, momentum=0.9)) as server, \
            ServerThread(None, endpoint=replica_ep) as replica:
        assert server.store is not None
        for u in updates:
            server.call(lambda u=u: server.store.apply(server.store.version, u))
        sampler = ReplicaSampler(server.store, replica.address, job=JOB, token=TOKEN,
                                 interval=60.0, metrics=server.metrics)

        async def sample_once():
            from mlfabric.client.link import open_link
            from mlfabric.wire.handshake import ClientHandshake

            link = await open_link(replica.address, ClientHandshake(JOB, TOKEN, "t"), 10.0,
                                   "replica server")
            try:
                return await sampler.sample(link)
            finally:
                link.close()

        def run(coro):
            assert server._loop is not None
            return asyncio.run_coroutine_threadsafe(coro, server._loop).result(10)

        vs, vr, measured = run(sample_once())
        ref = Reference(model, 0.9)
        for u in updates:
            ref.apply(u)
        want = np.sqrt(sum(np.sum((ref.w[n].astype(np.float64) - model[n]) ** 2)
                           for n in model))
        assert (vs, vr) == (4, 0)
        assert abs(measured - want) <= 1e-6 * want
        raw = RawClient(replica.port)
        try:
            for seq, u in enumerate(updates, 1):
                raw.send(Push(req=seq, base_version=0, tensors=u, seq=seq))
                assert raw.recv_event().version == seq
        finally:
            raw.close()
        assert run(sample_once()) == (4, 4, 0.0)
    m = server.metrics
    assert m.replica_divergence_samples._value.get() == 2
    assert m.replica_divergence._value.get() == 0.0
    assert m.replica_divergence_lag._value.get() == 0
