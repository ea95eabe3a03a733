"""Point-to-point: tags, wildcards, order, probes, sizes, self-sends, objects, fairness, failures;
and buffers with the buffer protocol in collectives and messages."""

from __future__ import annotations

import array
import os
import signal
import time

import numpy as np
import pytest

import shmcoll
from shmcoll import ANY_SOURCE, ANY_TAG, PeerLostError, ShmcollError
from shmcoll.engine import mailbox


def _tags_and_order(comm):  # type: ignore[no-untyped-def]
    r, _n = comm.rank, comm.world_size
    if r == 0:
        for k in range(20):  # interleave two tags; same-tag messages must stay in order
            comm.send(np.array([k], np.int64), 1, tag=k % 2)
        comm.send(np.arange(5, dtype=np.float32), 1, tag=9)
        return None
    if r == 1:
        odd = [int(comm.recv(b := np.zeros(1, np.int64), 0, 1) and b[0]) for _ in range(10)]
        even = [int(comm.recv(b := np.zeros(1, np.int64), 0, 0) and b[0]) for _ in range(10)]
        big = np.zeros(8, np.float32)
        st = comm.recv(big, ANY_SOURCE, ANY_TAG)
        return odd, even, (st.source, st.tag, st.count, st.nbytes), big[:5].tolist()
    return None


def test_same_tag_messages_arrive_in_order_and_a_tag_can_pass_another(pools) -> None:  # type: ignore[no-untyped-def]
    res = pools.get(3).run(_tags_and_order)[1]
    assert res[0] == list(range(1, 20, 2)) and res[1] == list(range(0, 20, 2))
    assert res[2] == (0, 9, 5, 20) and res[3] == [0, 1, 2, 3, 4]


def _direct_and_general(comm):  # type: ignore[no-untyped-def]
    """A ping-pong of small messages never enters the general way (whose send and recv are
    made to fail here); a larger message, a tag passing another and a mismatched buffer still
    take it, and find the mailbox as the direct path left it."""
    r, peer = comm.rank, 1 - comm.rank
    p2p = comm._point_to_point()
    general = p2p.send, p2p.recv

    def refuse(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the general way was taken")

    x = np.zeros(3, np.int64)
    p2p.send = p2p.recv = refuse
    try:
        for k in range(200):
            if r == 0:
                comm.send(x + k, peer, tag=k % 3)
                st = comm.recv(x, peer, ANY_TAG)
            else:
                st = comm.recv(x, peer, k % 3)
                comm.send(x, peer, tag=4)
        direct = (st.source, st.tag, st.count, int(x[0]))
    finally:
        p2p.send, p2p.recv = general
    if r == 0:
        comm.send(np.arange(4, dtype=np.float32), peer, tag=5)  # waits as an unexpected message
        comm.send(np.arange(6, dtype=np.float32), peer, tag=6)
        comm.send(np.ones(1 << 17), peer, tag=7)  # 1 MiB: more than one slot
        comm.send(np.arange(2, dtype=np.int16), peer, tag=8)
        return direct
    six, four, big = np.zeros(6, np.float32), np.zeros(4, np.float32), np.zeros(1 << 17)
    comm.recv(six, peer, 6)  # tag 5 is first in the mailbox: the general way keeps it aside
    st4 = comm.recv(four, peer, 5)
    comm.recv(big, peer, 7)
    with pytest.raises(TypeError, match="int16"):
        comm.recv(np.zeros(2, np.int32), peer, 8)  # the message stays
    st8 = comm.recv(small := np.zeros(2, np.int16), peer, 8)
    return direct, six.tolist(), (st4.tag, four.tolist()), float(big.sum()), (st8.count, small.tolist())


def test_small_blocking_messages_take_the_direct_path(pools) -> None:  # type: ignore[no-untyped-def]
    first, second = pools.get(2).run(_direct_and_general)
    assert first == (1, 4, 3, sum(range(200))) and second[0] == (0, 199 % 3, 3, sum(range(200)))
    assert second[1:] == ([0, 1, 2, 3, 4, 5], (5, [0, 1, 2, 3]), float(1 << 17), (2, [0, 1]))


def _lean_and_the_rules(comm):  # type: ignore[no-untyped-def]
    """A ping-pong repeated with the same arrays runs on the lean path (the direct path, made to
    count its calls here, is entered only by the first two sends; a receive whose message comes
    later than the lean path's spin and yields waits on the direct path); around it the
    matching rules hold: a message of another size or tag into the same buffer gets its own
    Status, a message kept aside or a nonblocking send queued ahead sends the next call the
    general way and keeps the order, and a buffer made read-only or given another dtype in place
    is refused as on any path."""
    r, peer = comm.rank, 1 - comm.rank
    p2p = comm._point_to_point()
    calls = {"send_now": 0, "recv_now": 0, "recv_again": 0}
    direct = p2p.send_now, p2p.recv_now
    again = p2p.recv_again

    def lean_recv(*args):  # type: ignore[no-untyped-def]
        st = again(*args)
        calls["recv_again"] += st is not None
        return st

    def counted(name, fn):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return fn(*args)

        return call

    p2p.send_now, p2p.recv_now = counted("send_now", direct[0]), counted("recv_now", direct[1])
    p2p.recv_again = lean_recv
    x, got = np.zeros(3, np.int64), np.zeros(3, np.int64)
    seen = []
    try:
        for k in range(100):
            x[:] = (k, r, k * k)
            if r == 0:
                comm.send(x, peer, tag=2)
                st = comm.recv(got, peer)
            else:
                st = comm.recv(got, peer)
                comm.send(x, peer, tag=2)
            seen.append((st.source, st.tag, st.count, got.tolist() == [k, peer, k * k]))
    finally:
        p2p.send_now, p2p.recv_now = direct
        p2p.recv_again = again
    taken = calls["recv_again"] + calls["recv_now"]
    lean = (calls["send_now"], calls["recv_again"], taken, all(s == (peer, 2, 3, True) for s in seen))
    if r == 0:
        comm.send(np.arange(2, dtype=np.int64), peer, tag=9)  # another size and tag, same buffer
        x[:] = 7
        comm.send(x, peer, tag=2)
        comm.send(np.arange(3, dtype=np.int64), peer, tag=5)  # received second: kept aside
        comm.send(x, peer, tag=2)
        big = comm.isend(np.ones(1 << 16), peer, tag=2)  # 512 KiB: queued behind the mailbox
        x[:] = 8
        comm.send(x, peer, tag=2)  # after the queued message, never before it
        big.wait()
        comm.barrier()
        return lean
    statuses = []
    for _ in range(2):
        st = comm.recv(got, peer)
        statuses.append((st.tag, st.count, got[: st.count].tolist()))
    five = comm.recv(np.zeros(3, np.int64), peer, 5)  # the tag-2 message before it waits aside
    st = comm.recv(got, peer)
    statuses.append((five.tag, st.tag, st.count, got.tolist()))
    comm.recv(big := np.zeros(1 << 16), peer, 2)
    st = comm.recv(got, peer)
    statuses.append((float(big.sum()), st.count, got.tolist()))
    comm.barrier()
    got.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        comm.recv(got, peer)
    return lean, statuses


def test_repeated_messages_of_the_same_arrays_take_the_lean_path_and_keep_the_rules(pools) -> None:  # type: ignore[no-untyped-def]
    first, (second, statuses) = pools.get(2).run(_lean_and_the_rules)
    for send_now, lean_recvs, taken, right in (first, second):
        assert right and send_now == 2 and taken == 100 and lean_recvs >= 1
    assert statuses == [(9, 2, [0, 1]), (2, 3, [7, 7, 7]), (5, 2, 3, [7, 7, 7]), (float(1 << 16), 3, [8, 8, 8])]


def _lean_behind_pending_operations(comm):  # type: ignore[no-untyped-def]
    """With the lean path set up (two calls each way), a receive posted earlier gets the first
    message, and a send queued earlier goes first: while nonblocking operations are pending the
    lean path stands aside (a lean receive spinning for the next message would take it from the
    posted receive; a lean send into a slot freed meanwhile would pass the queued message)."""
    r, peer = comm.rank, 1 - comm.rank
    x, got = np.zeros(4), np.zeros(4)
    for _ in range(2):
        if r == 0:
            comm.send(x, peer, tag=3)
        else:
            comm.recv(got, peer)
    p2p = comm._point_to_point()
    memo = p2p._send_lean if r == 0 else p2p._recv_lean
    entered = []  # lean calls that did something while an operation was pending throughout (none may)
    enter = memo[4]

    def watched(address):  # type: ignore[no-untyped-def]
        with p2p._lock:
            before = set(p2p._tracked)
        got = enter(address)
        with p2p._lock:
            if before & p2p._tracked and got != mailbox.BUSY:
                entered.append(got)
        return got

    memo[4] = watched
    comm.barrier()
    big_n = 1 << 20  # 8 MiB: 128 fragments, moved by both ranks' progress threads
    if r == 1:
        first = comm.irecv(posted := np.zeros(4), peer)  # posted before the lean receive below
        big = comm.irecv(large := np.zeros(big_n), peer, 4)
        comm.barrier()
        st = comm.recv(got, peer)  # the second tag-3 message, never the first
        got_first = got[0]
        first.wait()
        big.wait()
        st2 = comm.recv(got, peer)
        memo[4] = enter  # (the pool's ranks live on)
        return float(posted[0]), (st.tag, float(got_first)), float(large[-1]), (st2.tag, float(got[0])), entered
    comm.barrier()
    comm.send(np.full(4, 1.0), peer, tag=3)  # the posted receive's
    comm.send(np.full(4, 2.0), peer, tag=3)  # the lean receive's
    req = comm.isend(np.full(big_n, 5.0), peer, tag=4)  # mostly queued: the mailbox holds a few slots
    x[:] = 6.0
    comm.send(x, peer, tag=3)  # behind the queued fragments
    req.wait()
    memo[4] = enter  # (the pool's ranks live on)
    return entered


def test_the_lean_path_stands_aside_for_pending_operations(pools) -> None:  # type: ignore[no-untyped-def]
    sender, receiver = pools.get(2).run(_lean_behind_pending_operations)
    assert receiver == (1.0, (3, 2.0), 5.0, (3, 6.0), []) and sender == []


def _two_threads(comm):  # type: ignore[no-untyped-def]
    """Two threads of each rank exchange messages at once on one communicator: one repeats the
    same arrays with tag 1 (the lean path, holding the gate and no lock), the other sends new
    arrays with tag 2, a nonblocking receive posted around every other one (the general path).
    Every message arrives whole and in order; nothing hangs."""
    import threading

    peer = 1 - comm.rank
    rounds = 1000
    results: dict[int, list[int]] = {1: [], 2: []}
    errors: list[BaseException] = []

    def lean() -> None:
        x, got = np.zeros(8, np.int64), np.zeros(8, np.int64)
        for k in range(rounds):
            x[:] = k
            comm.send(x, peer, tag=1)
            comm.recv(got, peer, 1)
            results[1].append(int(got.sum()) // 8)

    def general() -> None:
        for k in range(rounds):
            comm.send(np.full(5, k, np.int64), peer, tag=2)
            if k % 2:
                req = comm.irecv(got := np.zeros(5, np.int64), peer, 2)
                req.wait()
            else:
                comm.recv(got := np.zeros(5, np.int64), peer, 2)
            results[2].append(int(got[0]) if (got == got[0]).all() else -1)

    def run(fn):  # type: ignore[no-untyped-def]
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(fn,), daemon=True) for fn in (lean, general)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results[1] == list(range(rounds)), results[2] == list(range(rounds)), any(t.is_alive() for t in threads)


def test_threads_sharing_a_communicator_mix_the_lean_and_general_paths(pools) -> None:  # type: ignore[no-untyped-def]
    for lean_ok, general_ok, hung in pools.get(2).run(_two_threads):
        assert lean_ok and general_ok and not hung


def _self_and_both_ways(comm):  # type: ignore[no-untyped-def]
    r, n = comm.rank, comm.world_size
    small = np.arange(3, dtype=np.int32)
    comm.send(small, r, tag=1)  # to oneself, received later
    big = np.full(3 << 18, float(r))  # 6 MiB: far more than the mailbox
    comm.send(big, r, tag=2)  # to oneself, larger than the mailbox, blocking: still completes
    comm.send(big, (r + 1) % n, tag=3)  # everyone sends a large message first, then receives
    got = np.zeros_like(big)
    comm.recv(got, (r - 1) % n, 3)
    mine = np.zeros_like(big)
    comm.recv(mine, r, 2)
    back = np.zeros(3, np.int32)
    st = comm.recv(back, r, 1)
    return st.source == r, back.tolist(), float(got[0]), float(got[-1]), float(mine[7])


def test_self_sends_and_large_sends_both_ways_complete(pools) -> None:  # type: ignore[no-untyped-def]
    res = pools.get(3).run(_self_and_both_ways)
    for r, (own, back, first, last, mine) in enumerate(res):
        assert own and back == [0, 1, 2] and first == last == (r - 1) % 3 and mine == r


def _sizes_and_dtypes(comm):  # type: ignore[no-untyped-def]
    if comm.rank == 0:
        comm.send(np.ones(10), 1, tag=4)
        comm.send(np.ones(3, np.int16), 1, tag=5)
        return None
    with pytest.raises(ValueError, match="80 bytes, the buffer holds 40"):
        comm.recv(np.zeros(5), 0, 4)
    with pytest.raises(TypeError, match="sent int16"):
        comm.recv(np.zeros(3), 0, 5)
    room = np.zeros(16)
    st = comm.recv(room, 0, 4)  # the messages stayed; a larger buffer is fine
    small = np.zeros(3, np.int16)
    comm.recv(small, 0, 5)
    return st.count, room[:11].tolist(), small.tolist()


def test_a_buffer_too_small_or_of_another_dtype_is_an_error_and_the_message_stays(pools) -> None:  # type: ignore[no-untyped-def]
    assert pools.get(2).run(_sizes_and_dtypes)[1] == (10, [1.0] * 10 + [0.0], [1, 1, 1])


def _probes(comm):  # type: ignore[no-untyped-def]
    r = comm.rank
    if r == 0:
        comm.barrier()
        comm.broadcast(np.ones(4), root=0)  # collective traffic is never seen by a probe
        comm.send(np.arange(6, dtype=np.int64), 1, tag=8)
        comm.send_object({"hello": [1, 2]}, 1, tag=3)
        return None
    comm.barrier()
    assert comm.iprobe(0, 99) is None
    st = comm.probe(0, 8, timeout=30)
    again = comm.iprobe(ANY_SOURCE, ANY_TAG)  # probing does not take it
    got = np.zeros(6, np.int64)
    comm.recv(got, st.source, st.tag)
    comm.broadcast(np.zeros(4), root=0)
    obj = comm.recv_object(0, 3)
    return (st.source, st.tag, st.count), again == st, got.tolist(), obj


def test_probes_see_only_point_to_point_messages_and_do_not_take_them(pools) -> None:  # type: ignore[no-untyped-def]
    res = pools.get(2).run(_probes)[1]
    assert res == ((0, 8, 6), True, [0, 1, 2, 3, 4, 5], {"hello": [1, 2]})


def _nonblocking_p2p(comm):  # type: ignore[no-untyped-def]
    r, n = comm.rank, comm.world_size
    recvs = [comm.irecv(np.zeros(4), ANY_SOURCE, 7) for _ in range(n - 1)]
    time.sleep(0.2)  # posted before anything was sent
    sends = [comm.isend(np.full(4, float(p)), p, 7) for p in range(n) if p != r]
    i = shmcoll.wait_any(recvs)
    statuses = shmcoll.wait_all(recvs)
    shmcoll.wait_all(sends)
    st = comm.sendrecv(np.full(2, float(r)), (r + 1) % n, got := np.zeros(2), (r - 1) % n)
    return i in range(n - 1), sorted(s.source for s in statuses), st.source, float(got[0])


def test_isend_irecv_wait_any_and_sendrecv(pools) -> None:  # type: ignore[no-untyped-def]
    res = pools.get(3).run(_nonblocking_p2p)
    for r, (any_ok, sources, src, value) in enumerate(res):
        assert any_ok and sources == sorted(set(range(3)) - {r}) and src == (r - 1) % 3 and value == (r - 1) % 3


def _fairness(comm):  # type: ignore[no-untyped-def]
    r, n = comm.rank, comm.world_size
    rounds = 30
    if r != 0:
        for k in range(rounds):
            comm.send(np.array([r, k], np.int64), 0, tag=1)
        return None
    time.sleep(0.3)  # every sender has filled its mailbox (and more is queued behind)
    order = []
    for _ in range(rounds * (n - 1)):
        b = np.zeros(2, np.int64)
        comm.recv(b, ANY_SOURCE, 1)
        order.append(int(b[0]))
    # No sender is starved: in the first quarter of the receives every sender already appears.
    return sorted(set(order[: len(order) // 4])), [order.count(s) for s in range(1, n)]


def test_any_source_serves_every_sender(pools) -> None:  # type: ignore[no-untyped-def]
    seen, counts = pools.get(4).run(_fairness)[0]
    assert seen == [1, 2, 3] and counts == [30, 30, 30]


def _never_matches(comm):  # type: ignore[no-untyped-def]
    if comm.rank == 0:
        comm.send(np.ones(2), 1, tag=5)
        time.sleep(1.5)
        return None
    with pytest.raises(shmcoll.CollectiveTimeout) as info:
        comm.recv(np.zeros(2), 0, tag=6, timeout=0.5)
    return str(info.value)


def test_a_receive_that_never_matches_times_out_naming_itself_and_what_arrived() -> None:
    text = shmcoll.spawn(_never_matches, 2, timeout=60)[1]
    assert "recv(src=0, tag=6) timed out after 0.5s" in text and "from rank 0 tag 5" in text, text


def _peer_dies_during_recv(comm):  # type: ignore[no-untyped-def]
    comm.barrier()
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(PeerLostError) as info:
        comm.recv(np.zeros(2), 1, 0, timeout=30)
    return info.value.dead_rank, time.monotonic() - t0


def test_a_receive_from_a_dead_peer_raises_within_seconds(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(shmcoll.SpawnError) as info:
        shmcoll.spawn(_peer_dies_during_recv, 2, timeout=60)
    assert info.value.rank == 1


def _sends_then_closes(comm):  # type: ignore[no-untyped-def]
    """Rank 1 sends late and closes its communicator; rank 0's receive looked for the message just
    before it came, and looks at its peers only once rank 1 has closed (held back here to make
    that moment certain): the message is there, so the receive must return it."""
    comm.barrier()
    if comm.rank == 1:
        time.sleep(0.3)  # past rank 0's first look at its peers (p2p._CHECK_S)
        comm.send(np.full(2, 7.0), 0, tag=3)
        return None
    arena = comm._arena
    real = arena.peer_status

    def held_back(rank):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 30
        while real(rank) != "exited" and time.monotonic() < deadline:
            time.sleep(0.001)
        return real(rank)

    arena.peer_status = held_back
    out = np.zeros(2)
    try:
        comm.recv(out, 1, tag=3, timeout=30)
    finally:
        del arena.peer_status
    return out.tolist()


def test_a_message_sent_before_its_sender_closed_is_received() -> None:
    assert shmcoll.spawn(_sends_then_closes, 2, timeout=60)[0] == [7.0, 7.0]


def _buffers(comm):  # type: ignore[no-untyped-def]
    r = comm.rank
    ba = bytearray([r + 1] * 4)
    res = comm.allreduce(ba, op="max")  # in place: the same bytearray comes back
    arr = array.array("f", [float(r)] * 3)
    out = array.array("f", [0.0] * 3)
    res2 = comm.allreduce(arr, out=out)
    mv = memoryview(np.full(5, r, np.int32))
    gathered = comm.allgather(mv)
    if r == 0:
        comm.send(bytearray(b"hey"), 1, tag=2)
    elif r == 1:
        got = bytearray(3)
        comm.recv(got, 0, 2)
        assert bytes(got) == b"hey"
    return res is ba, list(ba), res2 is out, list(out), gathered.tolist()


def test_objects_with_the_buffer_protocol_work_in_place_and_zero_copy(pools) -> None:  # type: ignore[no-untyped-def]
    res = pools.get(2).run(_buffers)
    for same, ba, same2, out, gathered in res:
        assert same and ba == [2] * 4 and same2 and out == [1.0] * 3 and gathered == [[0] * 5, [1] * 5]


def _bad_p2p_arguments(comm):  # type: ignore[no-untyped-def]
    for fn, exc in [
        (lambda: comm.send(np.ones(2), 5), ValueError),
        (lambda: comm.send(np.ones(2), 0, tag=-2), ValueError),
        (lambda: comm.send(np.ones(2), 0, tag="a"), TypeError),
        (lambda: comm.recv([1, 2], 0), TypeError),
        (lambda: comm.isend(np.ones(4)[::2], 0), ValueError),
        (lambda: comm.send_object(lambda: 1, 0), TypeError),
    ]:
        with pytest.raises(exc):
            fn()
    with pytest.raises(ShmcollError):
        comm.probe(0, 1, timeout=0.2)  # nothing comes: a timeout (the communicator breaks)
    return True


def test_bad_point_to_point_arguments_fail_before_sending() -> None:
    assert shmcoll.spawn(_bad_p2p_arguments, 1, timeout=60) == [True]
