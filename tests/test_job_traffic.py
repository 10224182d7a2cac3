"""The job's own TCP traffic: parsing sock_diag dumps, per-socket accounting,
and the live kernel counters of a real connection against getsockopt(TCP_INFO).

The emulated-cluster check (socket counters against the NIC counters of a
shaped veth link) is in test_agent_testbed.py.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Sequence

import pytest

from mlfabric.agent import job_traffic as jt
from mlfabric.agent.job_traffic import JobTraffic, TcpSocketBytes


def _info(received: int, sent: int, segs_out: int, segs_in: int, *, length: int = 232,
          acked: int = 0) -> bytes:
    info = bytearray(length)
    struct.pack_into("=Q", info, jt._BYTES_ACKED, acked)
    struct.pack_into("=Q", info, jt._BYTES_RECEIVED, received)
    struct.pack_into("=II", info, jt._SEGS, segs_out, segs_in)
    if length >= jt._BYTES_SENT + 8:
        struct.pack_into("=Q", info, jt._BYTES_SENT, sent)
    return bytes(info)


def _diag_msg(sport: int, dport: int, src: str, dst: str, cookie: int,
              info: bytes | None, family: int = socket.AF_INET) -> bytes:
    raw = socket.inet_pton(family, src).ljust(16, b"\0"), socket.inet_pton(family, dst).ljust(
        16, b"\0")
    body = (jt._DIAG_MSG_HEAD.pack(family, 1, 0, 0) + jt._SOCKID.pack(sport, dport, *raw)
            + jt._SOCKID_REST.pack(0, cookie & 0xFFFFFFFF, cookie >> 32)
            + jt._DIAG_MSG_TAIL.pack(0, 0, 0, 0, 0))
    if info is not None:
        attr = jt._RTATTR.pack(jt._RTATTR.size + len(info), jt.INET_DIAG_INFO) + info
        body += attr + bytes(-len(attr) % 4)
    return jt._NLMSGHDR.pack(jt._NLMSGHDR.size + len(body), jt.SOCK_DIAG_BY_FAMILY, 2, 1,
                             0) + body


def _done() -> bytes:
    return jt._NLMSGHDR.pack(jt._NLMSGHDR.size + 4, jt.NLMSG_DONE, 2, 1, 0) + bytes(4)


def test_request_asks_for_tcp_info_of_every_tcp_socket() -> None:
    req = jt.build_request(socket.AF_INET6, 7)
    length, kind, flags, seq, _ = jt._NLMSGHDR.unpack_from(req)
    assert (length, kind, seq) == (len(req), jt.SOCK_DIAG_BY_FAMILY, 7)
    assert flags == jt.NLM_F_REQUEST | jt.NLM_F_DUMP
    family, proto, ext, _, states = jt._REQ_V2.unpack_from(req, jt._NLMSGHDR.size)
    assert (family, proto, ext, states) == (socket.AF_INET6, socket.IPPROTO_TCP, 2, 0xFFFFFFFF)


def test_parse_dump_reads_endpoints_and_wire_bytes() -> None:
    data = (_diag_msg(7100, 40000, "10.0.0.1", "10.0.0.2", (3 << 32) | 5,
                      _info(received=1_000_000, sent=2000, segs_out=400, segs_in=700))
            + _diag_msg(7100, 0, "10.0.0.1", "0.0.0.0", 9, None)  # listening: no info
            + _done())
    sockets, done = jt.parse_dump(data)
    assert done
    assert sockets == [TcpSocketBytes(cookie=(3 << 32) | 5, local=("10.0.0.1", 7100),
                                      remote=("10.0.0.2", 40000),
                                      rx_bytes=1_000_000 + 700 * 66, tx_bytes=2000 + 400 * 66)]


def test_parse_dump_of_an_old_kernel_counts_acked_bytes_and_ipv6() -> None:
    old = _info(received=10, sent=999, segs_out=1, segs_in=2, length=jt._MIN_INFO, acked=20)
    data = _diag_msg(1, 2, "fd00::1", "fd00::2", 1, old, family=socket.AF_INET6)
    sockets, done = jt.parse_dump(data)
    assert not done  # more messages follow in the next recv()
    assert sockets[0].remote == ("fd00::2", 2)
    assert (sockets[0].rx_bytes, sockets[0].tx_bytes) == (10 + 2 * 66, 20 + 66)
    too_old = _info(1, 1, 1, 1, length=jt._MIN_INFO)[:-8]
    assert jt.parse_dump(_diag_msg(1, 2, "10.0.0.1", "10.0.0.2", 1, too_old)) == ([], False)


def test_parse_dump_raises_on_a_netlink_error_and_a_truncated_message() -> None:
    err = jt._NLMSGHDR.pack(jt._NLMSGHDR.size + 4, jt.NLMSG_ERROR, 0, 1, 0) + struct.pack(
        "=i", -13)
    with pytest.raises(OSError, match="sock_diag dump failed"):
        jt.parse_dump(err)
    msg = _diag_msg(1, 2, "10.0.0.1", "10.0.0.2", 1, _info(1, 1, 1, 1))
    with pytest.raises(ValueError, match="truncated netlink message"):
        jt.parse_dump(msg[:-8])


def _error_msg(code: int) -> bytes:
    return jt._NLMSGHDR.pack(jt._NLMSGHDR.size + 4, jt.NLMSG_ERROR, 0, 1, 0) + struct.pack(
        "=i", -code)


@pytest.mark.parametrize("family, local, remote", [
    (socket.AF_INET, "10.0.0.1", "10.0.0.2"),
    (socket.AF_INET6, "fd00::1", "fd00::2"),
    (socket.AF_INET6, "::ffff:10.0.0.1", "::ffff:10.0.0.2"),  # a dual-stack socket
])
def test_lookup_asks_for_one_socket_by_its_endpoints_and_cookie(family: int, local: str,
                                                                remote: str) -> None:
    s = TcpSocketBytes((7 << 32) | 9, (local, 7100), (remote, 40000), 0, 0)
    req = jt.build_lookup(s, 5)
    length, kind, flags, seq, _ = jt._NLMSGHDR.unpack_from(req)
    assert (length, kind, flags, seq) == (len(req), jt.SOCK_DIAG_BY_FAMILY, jt.NLM_F_REQUEST, 5)
    fam, proto, ext, _, _ = jt._REQ_V2.unpack_from(req, jt._NLMSGHDR.size)
    assert (fam, proto, ext) == (family, socket.IPPROTO_TCP, 2)
    off = jt._NLMSGHDR.size + jt._REQ_V2.size
    sport, dport, src, dst = jt._SOCKID.unpack_from(req, off)
    _ifc, c0, c1 = jt._SOCKID_REST.unpack_from(req, off + jt._SOCKID.size)
    assert (sport, dport, (c1 << 32) | c0) == (7100, 40000, (7 << 32) | 9)
    assert src == socket.inet_pton(family, local).ljust(16, b"\0")
    assert dst == socket.inet_pton(family, remote).ljust(16, b"\0")


def test_parse_lookups_counts_every_answer_and_raises_on_a_real_error() -> None:
    live = _diag_msg(7100, 40000, "10.0.0.1", "10.0.0.2", 3, _info(10, 20, 1, 1))
    time_wait = _diag_msg(7100, 40001, "10.0.0.1", "10.0.0.2", 4, None)  # no tcp_info
    sockets, answers = jt.parse_lookups(live + time_wait + _error_msg(2))  # 2: ENOENT, gone
    assert answers == 3
    assert [x.cookie for x in sockets] == [3]
    assert jt.parse_lookups(b"") == ([], 0)
    with pytest.raises(OSError, match="sock_diag lookup failed: Permission denied"):
        jt.parse_lookups(_error_msg(13))
    with pytest.raises(OSError, match="sock_diag dump failed: Permission denied"):
        jt.parse_dump(_error_msg(13))


def _sock(cookie: int, lport: int, rport: int, rx: int, tx: int,
          local: str = "10.0.0.1", remote: str = "10.0.0.2") -> TcpSocketBytes:
    return TcpSocketBytes(cookie, (local, lport), (remote, rport), rx, tx)


def test_job_traffic_adds_each_sockets_growth_on_the_jobs_ports_only() -> None:
    t = JobTraffic([7100])
    assert t.update([_sock(1, 7100, 5000, 100, 10), _sock(2, 6000, 80, 999, 999)]) == (100, 10)
    # socket 1 grew, socket 3 is new (counted in full), the other port never counts
    assert t.update([_sock(1, 7100, 5000, 150, 15), _sock(3, 5001, 7100, 40, 4000),
                     _sock(2, 6000, 80, 5000, 5000)]) == (190, 4015)
    # socket 1 closed: what it had is kept, nothing is taken back
    assert t.update([_sock(3, 5001, 7100, 41, 4000)]) == (191, 4015)
    # a socket that reappears after a gap is a new socket (its cookie was forgotten)
    assert t.update([_sock(1, 7100, 5000, 10, 0)]) == (201, 4015)


def test_job_traffic_ignores_connections_that_stay_on_the_host() -> None:
    t = JobTraffic([7401])
    same = _sock(1, 7401, 5000, 100, 100, local="10.0.0.1", remote="10.0.0.1")
    loop = _sock(2, 5000, 7401, 100, 100, local="127.0.0.1", remote="127.0.0.1")
    loop6 = _sock(3, 5000, 7401, 100, 100, local="::1", remote="::1")
    assert t.update([same, loop, loop6]) == (0, 0)


def test_live_counters_match_the_sockets_own_tcp_info() -> None:
    """The dump's numbers for a real connection are the kernel's own (TCP_INFO)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    with srv, socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        s, _ = srv.accept()
        with s:
            n = 3_000_000
            got = bytearray()

            def read() -> None:
                while len(got) < n:
                    got.extend(s.recv(1 << 20))

            t = threading.Thread(target=read)
            t.start()
            c.sendall(b"x" * n)
            t.join(10)
            assert len(got) == n
            diag = jt.SockDiag()
            try:
                found = {x.local: x for x in diag.dump() if port in (x.local[1], x.remote[1])}
            finally:
                diag.close()
            for sock in (c, s):
                info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 512)
                want = jt._tcp_info_bytes(info)
                entry = found[sock.getsockname()]
                assert (entry.rx_bytes, entry.tx_bytes) == want
            assert found[s.getsockname()].rx_bytes >= n  # payload plus headers


class _CountingDiag(jt.SockDiag):
    """The real netlink socket, counting what the reader asks it for."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def dump(self) -> list[TcpSocketBytes]:
        self.calls.append("dump")
        return super().dump()

    def lookup(self, sockets: Sequence[TcpSocketBytes]) -> list[TcpSocketBytes]:
        self.calls.append(f"lookup {len(sockets)}")
        return super().lookup(sockets)


def _connected_pair(srv: socket.socket) -> tuple[socket.socket, socket.socket]:
    c = socket.create_connection(srv.getsockname()[:2], timeout=5)
    s, _ = srv.accept()
    return c, s


def _send(a: socket.socket, b: socket.socket, n: int) -> None:
    a.sendall(b"x" * n)
    got = 0
    while got < n:
        got += len(b.recv(1 << 20))


def test_lookups_follow_known_sockets_and_a_dump_finds_new_ones() -> None:
    """Live sockets on this host's loopback (so every port is counted: the
    loopback filter is tested above). Between dumps the reader asks for the
    sockets it knows, whose counters stay exact; a connection opened since is
    found by the next dump and counted in full, a closed one is forgotten."""
    now = [0.0]
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    diag = _CountingDiag()
    reader = jt.JobTrafficReader([port], rediscover=1.0, clock=lambda: now[0], diag=diag)
    # the listening socket (remote port 0) moves nothing: left out, as the agent's is
    reader.traffic.is_job = (  # type: ignore[method-assign]
        lambda s: s.remote[1] != 0 and port in (s.local[1], s.remote[1]))

    def tcp_info_total(*socks: socket.socket) -> tuple[int, int]:
        rx = tx = 0
        for sock in socks:
            got = jt._tcp_info_bytes(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 512))
            assert got is not None
            rx, tx = rx + got[0], tx + got[1]
        return rx, tx

    try:
        c1, s1 = _connected_pair(srv)
        _send(c1, s1, 100_000)
        assert reader() == tcp_info_total(c1, s1)
        assert diag.calls == ["dump"]
        # known sockets: looked up, exact
        now[0] = 0.5
        _send(s1, c1, 300_000)
        c2, s2 = _connected_pair(srv)
        _send(c2, s2, 50_000)
        assert reader() == tcp_info_total(c1, s1)  # the new pair is not known yet
        assert diag.calls == ["dump", "lookup 2"]
        # the next dump finds the new pair, its bytes in full
        now[0] = 1.0
        assert reader() == tcp_info_total(c1, s1, c2, s2)
        assert diag.calls[-1] == "dump"
        # a closed pair: its last bytes stay counted, nothing is taken back
        before = reader()
        c1.close()
        s1.close()
        now[0] = 1.5
        assert reader() == before
        assert {s.local for s in reader.traffic.known()} == {c2.getsockname(),
                                                             s2.getsockname()}
        assert diag.calls[-2:] == ["lookup 4", "lookup 4"]
        c2.close()
        s2.close()
    finally:
        srv.close()
        reader.close()
    assert diag.calls == ["dump", "lookup 2", "dump", "lookup 4", "lookup 4"]


def test_parse_reads_the_kernels_delivery_rate_and_app_limited_bit() -> None:
    """struct tcp_info carries the delivery-rate sample BBR uses (bytes/s) and
    whether the sender was app-limited then (bit 0 of byte 7)."""
    info = bytearray(_info(10, 20, 1, 1))
    struct.pack_into("=Q", info, jt._DELIVERY_RATE, 12_000_000)  # 96 Mbit/s
    bulk = _diag_msg(40001, 7100, "10.0.0.1", "10.0.0.2", 1, bytes(info))
    info[jt._APP_LIMITED_BYTE] |= 1
    idle = _diag_msg(40002, 7100, "10.0.0.1", "10.0.0.3", 2, bytes(info))
    old = _diag_msg(40003, 7100, "10.0.0.1", "10.0.0.4", 3, _info(10, 20, 1, 1, length=160))
    socks, done = jt.parse_dump(bulk + idle + old + _done())
    assert done
    assert [(s.delivery_bps, s.app_limited) for s in socks] == [
        (96e6, False), (96e6, True), (0.0, True)]


def test_job_traffic_keeps_the_delivery_rates_of_bulk_sending_job_flows() -> None:
    """Per remote address, the largest delivery rate among the job's flows
    that sent at least min_sent bytes since the last reading and were not
    app-limited; nothing from a flow seen for the first time (its history is
    unknown), a slow or app-limited one, or another port's."""
    t = JobTraffic([7100], min_sent=1000)

    def flow(cookie: int, remote: str, tx: int, rate: float, limited: bool = False,
             port: int = 7100) -> TcpSocketBytes:
        return TcpSocketBytes(cookie, ("10.0.0.1", 40000 + cookie), (remote, port), 0, tx,
                              rate, limited)

    t.update([flow(1, "10.0.0.2", 0, 0.0), flow(2, "10.0.0.2", 0, 0.0),
              flow(3, "10.0.0.3", 0, 0.0), flow(4, "10.0.0.4", 0, 0.0),
              flow(5, "10.0.0.5", 0, 0.0, port=80)])
    assert t.deliveries == {}
    t.update([flow(1, "10.0.0.2", 5000, 50e6), flow(2, "10.0.0.2", 5000, 70e6),
              flow(3, "10.0.0.3", 500, 90e6), flow(4, "10.0.0.4", 5000, 90e6, limited=True),
              flow(5, "10.0.0.5", 5000, 90e6, port=80), flow(6, "10.0.0.6", 9000, 90e6)])
    assert t.deliveries == {"10.0.0.2": 70e6}
    t.update([flow(1, "10.0.0.2", 5000, 50e6)])  # nothing sent since
    assert t.deliveries == {}
