"""A frame sent straight from many arrays (runtime._sendv, runtime.loop.
write_parts): the bytes on the socket are exactly the planned block, whether
the socket takes all of it, part of it, or the transport already has bytes
queued; a bad plan is refused before a byte is read."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

from mlfabric.runtime import _sendv
from mlfabric.runtime import loop as loops
from mlfabric.runtime.loop import write_parts
from mlfabric.wire.protocol import (
    NEED_DATA,
    BlockPlan,
    Connection,
    LaidOutTensors,
    Push,
    TensorSpec,
    expand_parts,
)

F4 = np.dtype("<f4")


def plan_of(index, starts, lengths, offsets, total):
    return [np.array(x, np.intp) for x in (index, starts, lengths, offsets)] + [total]


def reference(arrays, index, starts, lengths, offsets, total):
    block = np.zeros(total, np.uint8)
    for i, s, n, o in zip(index, starts, lengths, offsets, strict=True):
        block[o:o + n] = arrays[i].reshape(-1).view(np.uint8)[s:s + n]
    return block.tobytes()


def recv_all(sock, n):
    got = bytearray()
    while len(got) < n:
        chunk = sock.recv(n - len(got))
        assert chunk, f"the peer closed after {len(got)} of {n} bytes"
        got += chunk
    return bytes(got)


# Pieces from whole arrays and from slices, a zero-length piece, gaps of a
# few bytes and of more than the 4 KiB zero buffer, and padding at the end.
RNG = np.random.default_rng(7)
ARRAYS = [RNG.standard_normal(n).astype(np.float32) for n in (5, 1000, 3, 70000)]
ARRAYS.append(RNG.standard_normal((30, 40)))  # float64, 2-D: any C-contiguous array
PLAN = ([0, 1, 3, 2, 3, 4, 3], [0, 0, 4, 0, 100, 16, 9], [20, 4000, 40, 12, 0, 800, 400],
        [0, 64, 4100, 4200, 4212, 9000, 9800], 12_345)


def test_sendv_writes_the_planned_block_byte_for_byte():
    plan = plan_of(*PLAN)
    want = b"HEAD" + reference(ARRAYS, *PLAN)
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        assert _sendv.sendv(a.fileno(), b"HEAD", ARRAYS, *plan) == len(want)
        assert recv_all(b, len(want)) == want
    for skip in (0, 1, 19, 20, 63, 64, 4099, 9000, 12_000, 12_345):
        assert bytes(_sendv.rest(ARRAYS, *plan, skip)) == want[4 + skip:], skip


def test_a_frame_the_socket_takes_in_part_is_completed_by_rest():
    """More pieces than one system call takes (IOV_MAX), into a socket whose
    buffer holds a fraction of them: what sendv wrote plus rest() is the
    frame."""
    arrays = [np.full(256, k, np.float32) for k in range(3000)]
    specs = tuple(TensorSpec(f"t{k}", F4, (256,)) for k in range(3000))
    whole = BlockPlan.whole(specs)
    plan = [whole.index, whole.starts, whole.lengths, whole.offsets, whole.total]
    want = b"H" * 10 + np.concatenate(arrays).tobytes()
    a, b = socket.socketpair()
    with a, b:
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 16)
        a.setblocking(False)
        sent = _sendv.sendv(a.fileno(), b"H" * 10, arrays, *plan)
        assert 0 < sent < len(want)
        got = recv_all(b, sent)
        # The socket is drained: the next call goes on where this one stopped.
        assert got + bytes(_sendv.rest(arrays, *plan, sent - 10)) == want


@pytest.mark.parametrize("change, error, message", [
    (dict(index=[0, 1, 9, 2, 3, 4, 3]), ValueError, "piece 2 of a block plan names array 9"),
    (dict(lengths=[20, 4000, 40, 12, 0, 800, 280_000]), ValueError,
     "piece 6 of a block plan: 280000 bytes from byte 9 of an array of 280000"),
    (dict(starts=[0, -1, 4, 0, 100, 16, 9]), ValueError, "piece 1 of a block plan: 4000 bytes"),
    (dict(offsets=[0, 64, 4100, 4000, 4212, 9000, 9800]), ValueError,
     "piece 3 of a block plan: 12 bytes at offset 4000, after 4140 bytes placed"),
    (dict(total=10_000), ValueError, "piece 6 of a block plan: 400 bytes at offset 9800"),
    (dict(arrays=[*ARRAYS[:4], np.zeros((40, 30))[:, :20]]), TypeError,
     "array 4 is not a C-contiguous numpy array"),
    (dict(arrays=[*ARRAYS[:4], b"x" * 10_000]), TypeError, "array 4 is not a C-contiguous"),
])
def test_a_bad_plan_is_refused_before_a_byte_is_sent(change, error, message):
    fields = dict(zip(("index", "starts", "lengths", "offsets", "total"), PLAN, strict=True))
    arrays = change.pop("arrays", ARRAYS)
    fields.update(change)
    plan = plan_of(**fields)
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        b.setblocking(False)
        with pytest.raises(error, match=message):
            _sendv.sendv(a.fileno(), b"HEAD", arrays, *plan)
        with pytest.raises(BlockingIOError):
            b.recv(1)  # nothing was written
        with pytest.raises(error, match=message):
            _sendv.rest(arrays, *plan, 0)


def test_a_socket_error_is_raised_as_oserror():
    a, b = socket.socketpair()
    b.close()
    with a, pytest.raises(OSError) as err:
        _sendv.sendv(a.fileno(), b"HEAD", ARRAYS, *plan_of(*PLAN))
    assert err.value.errno in (32, 104)  # EPIPE, ECONNRESET


def many_small(k, n=1024, seed=0):
    rng = np.random.default_rng(seed)
    specs = tuple(TensorSpec(f"t{i:04d}", F4, (n,)) for i in range(k))
    return specs, {s.name: rng.standard_normal(s.shape).astype(np.float32) for s in specs}


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_frames_from_arrays_arrive_whole_and_in_order_on_a_real_transport(kind):
    """Three pushes of 1,000 small tensors (4 MB each, more than the socket
    buffers hold) and a small frame between them, written back to back on a
    TCP transport: the first goes by sendmsg, in part, with its rest queued;
    the others find bytes queued and are queued as buffers. The far end
    decodes every frame, tensors equal to the updates."""
    specs, first = many_small(1000)
    updates = [first] + [many_small(1000, seed=s)[1] for s in (1, 2)]
    plan = BlockPlan.whole(specs)
    received: list = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        expected = 4

        async def serve(reader, writer):
            conn = Connection()
            while len(received) < expected:
                data = await reader.read(1 << 16)
                assert data, "the sender closed early"
                conn.receive_data(data)
                while (event := conn.next_event()) is not NEED_DATA:
                    received.append(event)
                await asyncio.sleep(0)  # a slow reader: the sender's buffer fills
            writer.close()
            done.set_result(None)

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        server.sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        port = server.sockets[0].getsockname()[1]
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        # Socket buffers far smaller than a frame, whatever the host's defaults.
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF,
                                                      1 << 16)
        conn = Connection()
        sizes = []
        for req, update in enumerate(updates):
            tensors = LaidOutTensors(specs, list(update.values()), plan)
            sizes.append(write_parts(transport, conn.send(Push(req, 0, tensors))))
            if req == 0:
                assert transport.get_write_buffer_size() > 0  # the socket took only part
                write_parts(transport, conn.send(Push(9, 0, {"x": np.ones(3, np.float32)})))
        assert sizes[0] == sizes[1] == sizes[2] > plan.total
        await asyncio.wait_for(done, 30)
        transport.close()
        server.close()
        await server.wait_closed()

    loops.run(main(), kind=kind)
    assert [e.req for e in received] == [0, 9, 1, 2]
    for event, update in zip([received[0], *received[2:]], updates, strict=True):
        assert list(event.tensors) == list(update)
        for name, a in update.items():
            assert np.array_equal(event.tensors[name], a)
    assert np.array_equal(received[1].tensors["x"], np.ones(3, np.float32))


def test_expand_parts_gives_the_same_bytes_as_the_gathered_frame():
    specs, update = many_small(40, n=33)
    tensors = LaidOutTensors(specs, list(update.values()), BlockPlan.whole(specs))
    parts = Connection().send(Push(1, 0, tensors))
    assert len(parts) == 2 and len(parts[1]) == BlockPlan.whole(specs).total
    assert b"".join(expand_parts(parts)) == Connection().send_bytes(Push(1, 0, update))
