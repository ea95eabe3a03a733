"""Point-to-point messages: tags, wildcards, probes, blocking and nonblocking forms.

Messages travel in the arena's mailboxes (``engine/mailbox.py``), apart from the collectives,
and are matched here the way MPI matches them:

- a receive names a source (or ``ANY_SOURCE``) and a tag (or ``ANY_TAG``); it takes the
  earliest message that arrived and matches, else it is **posted** and waits;
- a message that arrives is given to the earliest posted receive that matches, else it is kept
  as an **unexpected** message (its bytes copied out of the mailbox, so that later messages of
  the same sender can pass it: a receive for tag 7 is not blocked by a message with tag 5);
- messages between one pair of ranks with the same tag therefore arrive in order; across
  senders, ``ANY_SOURCE`` takes them in the order they arrived, and the mailboxes are served in
  turn, so no sender is starved;
- a send to oneself goes through one's own mailbox like any other.

Progress: every blocking call and every ``wait`` moves all outstanding messages of the
communicator (sends that did not fit, receives in flight), so a blocking send also drains what
arrives meanwhile (a pair of ranks sending large messages to each other then receiving does not
deadlock). Nonblocking operations are also moved by a thread of their own while the caller
computes; it sleeps on this rank's doorbell, which any peer rings when it fills or frees one of
our mailboxes. A lock serialises the matching, so point-to-point calls may come from several
threads.

The common blocking case takes a **direct path** instead, with nothing in between: a send that
fits in one free slot of its mailbox, with nothing queued before it and no nonblocking operation
outstanding, is written at once (:meth:`PointToPoint.send_now`); a receive from a named source,
with no receive posted, nothing unexpected from that source and no message of it half taken,
takes the mailbox's next message itself when it is one fragment that matches
(:meth:`PointToPoint.recv_now`, ``mailbox.take``), waiting as the collectives wait (spin, yield,
sleep). Anything else on the way (another tag first, a larger message, a dtype that does not
match) goes the general way, which finds the mailbox as it was. The general way costs ~80 Python
calls per message (15 us for a send and a receive to oneself, against 6 on the direct path).

A direct send or receive made again with the very same array (``is``), peer, tag and dtype takes
the **lean path** (:meth:`PointToPoint.send_again`, :meth:`PointToPoint.recv_again`), as the
collectives' repeated calls do: it enters compiled code through one int, a record of the
mailbox's arrays' addresses (``mailbox.send_at`` / ``recv_at``), which takes the **gate** instead
of the lock (:class:`_Guard`: two words the lock's holders hold too, and which say whether
anything is pending, in which case the lean call does nothing and the call goes the ways above);
a lean receive spins and yields for its message there and returns a Status shared with the last
message of the same size and tag. A ping-pong of 8 bytes at 2 ranks: 0.52 us per hop, 0.72 with
the lock and the checks in Python, 3.7-4.8 on the direct path (``benchmarks/handoff.py``,
interleaved runs; Open MPI in the same rounds 0.55-0.94).

A receive into a buffer smaller than its message, or of another dtype, raises ``ValueError`` /
``TypeError`` before anything is copied, and the message stays to be received with a fitting
buffer. A timeout, a lost peer or an abort breaks the communicator like a collective's.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from typing import Any

import numpy as np

from shmcoll import config
from shmcoll.comm import arrays
from shmcoll.comm.requests import _ANY_DONE, _ANY_WAITERS, _DONE, Request
from shmcoll.engine import cpu as engine
from shmcoll.engine import mailbox
from shmcoll.errors import CollectiveTimeout, PeerLostError
from shmcoll.shm import layout
from shmcoll.types import DTYPE_CODE, DTYPES, dtype_name, dtype_str

ANY_SOURCE = -1
ANY_TAG = -1
_MAX_TAG = (1 << 62) - 1
_SLEEP_NS = 5_000_000  # longest single sleep on the doorbell: bounds how late an abort is noticed
# How often a waiting call checks the abort word and its peers' liveness (as the collectives'
# slice, runtime._SLICE_NS), and its deadline if that comes later: a check reads /proc per peer,
# 8-19 us here, and checked at every wake-up (a doorbell rung for a freed slot wakes a receiver
# too) it cost a ping-pong of 8 bytes 20 us per hop.
_CHECK_S = 0.1
_OBJECT_DTYPE = 31  # the dtype code of pickled objects' bytes (send_object / recv_object)

Runtime = Any  # comm.runtime.Runtime


@dataclasses.dataclass(frozen=True)
class Status:
    """What a receive (or a probe) found: the message's source, tag and size.

    ``count`` is in elements of the receive's dtype (of the sender's, for a probe); ``nbytes`` in
    bytes.
    """

    source: int
    tag: int
    count: int
    nbytes: int


class _Receive:
    """A posted receive: where a matching message goes."""

    __slots__ = ("src", "tag", "out", "dtype", "req", "allocate")

    def __init__(self, src: int, tag: int, out: np.ndarray | None, dtype: np.dtype | None, req: Request) -> None:
        self.src, self.tag, self.out, self.dtype, self.req = src, tag, out, dtype, req
        self.allocate = out is None  # recv_object: a buffer of the message's size

    def matches(self, src: int, tag: int) -> bool:
        return (self.src == ANY_SOURCE or self.src == src) and (self.tag == ANY_TAG or self.tag == tag)


class _Message:
    """A message being received from a mailbox, or kept as unexpected."""

    __slots__ = ("src", "msg_id", "tag", "nbytes", "dtype", "order", "got", "total", "buf", "recv")

    def __init__(self, src: int, header: np.ndarray, order: int, total: int) -> None:
        self.src = src
        self.msg_id, self.tag, self.nbytes, self.dtype = (int(v) for v in header)
        self.order = order  # arrival order, across senders
        self.got = 0
        self.total = total
        self.buf: np.ndarray = np.empty(0, np.uint8)
        self.recv: _Receive | None = None

    @property
    def complete(self) -> bool:
        return self.got == self.total


class _Send:
    __slots__ = ("dst", "payload", "sent", "total", "msg_id", "tag", "nbytes", "dtype", "req")

    def __init__(self, dst: int, payload: np.ndarray, total: int, msg_id: int, tag: int, dtype: int, req: Request):
        self.dst, self.payload, self.sent, self.total = dst, payload, 0, total
        self.msg_id, self.tag, self.nbytes, self.dtype, self.req = msg_id, tag, payload.size, dtype, req


class PointToPoint:
    """One communicator's point-to-point state (see the module docstring)."""

    def __init__(self, rt: Runtime) -> None:
        self._rt = rt
        n = rt.world_size
        self._n = n
        self._geo = mailbox.geometry(rt._arena.layout, rt.rank)
        self._data = rt._arena.view(np.dtype(np.uint8))
        # A waiting caller spins and yields as the communicator's collectives do before it sleeps.
        self._wait = (int(rt._state[engine.S_SPIN_NS]), int(rt._state[engine.S_YIELDS]))
        self._lock = _Guard(self)  # (a Python lock and the lean path's gate: see _Guard)
        self._next_id = np.ones(n, np.int64)  # per outgoing mailbox (the lean path's send_at counts too)
        self._slot_bytes = int(self._geo[mailbox.G_SLOT_BYTES])
        self._current: list[_Message | None] = [None] * n  # the message being pulled, per sender
        self._unexpected: list[_Message] = []  # in arrival order
        self._posted: list[_Receive] = []  # in posting order
        self._sends: list[collections.deque[_Send]] = [collections.deque() for _ in range(n)]
        self._header = np.zeros(4, np.int64)
        self._order = 0
        self._turn = 0
        self._tracked: set[Request] = set()  # nonblocking operations not yet complete
        self._thread: threading.Thread | None = None
        self._wake = threading.Condition(self._lock)  # type: ignore[arg-type]  # (any lock with acquire/release)
        self._stopping = False
        # Peers found gone once by _check_waiting: the next look at one of them is fatal.
        self._gone: set[int] = set()
        # The lean path (see the module doc): the last direct send and receive, then, once one is
        # made again with the same arrays, its record for mailbox.send_at / recv_at.
        self._send_seen: tuple[Any, ...] | None = None
        self._send_lean: list[Any] | None = None
        self._recv_seen: tuple[Any, ...] | None = None
        self._recv_lean: list[Any] | None = None

    # --- the calls ----------------------------------------------------------------------------
    def send(
        self, x: Any, dst: int, tag: int, timeout: float | None, blocking: bool, dtype_code: int | None = None
    ) -> Request:
        payload, dtype = self._payload(x, "x")
        if dtype_code is not None:
            dtype = dtype_code
        self._check_peer(dst, "dst")
        _check_tag(tag, "tag", wildcard=False)
        req = Request(self, None, timeout, f"send(dst={dst}, tag={tag})", 0.0)
        with self._lock:
            self._rt._check_usable()
            msg_id = self._next_id.item(dst)
            self._next_id[dst] = msg_id + 1
            s = _Send(dst, payload, int(mailbox.fragments(self._geo, payload.size)), msg_id, tag, dtype, req)
            self._sends[dst].append(s)
            self._advance()
            self._track(req, blocking)
        return req

    def recv(
        self, buf: Any, src: int, tag: int, timeout: float | None, blocking: bool, allocate: bool = False
    ) -> Request:
        if allocate:
            out, dtype = None, None
        else:
            out, dtype = self._payload(buf, "buf", written=True)
        if src != ANY_SOURCE:
            self._check_peer(src, "src")
        _check_tag(tag, "tag", wildcard=True)
        what = f"recv(src={'ANY_SOURCE' if src == ANY_SOURCE else src}, tag={'ANY_TAG' if tag == ANY_TAG else tag})"
        req = Request(self, None, timeout, what, 0.0)
        r = _Receive(src, tag, out, None if dtype is None else DTYPES[dtype], req)
        req._bound = buf  # what wait() returns the Status of (and keeps the buffer alive)
        with self._lock:
            self._rt._check_usable()
            self._post(r)
            self._advance()
            self._track(req, blocking)
        return req

    def probe(self, src: int, tag: int, timeout: float | None, blocking: bool) -> Status | None:
        if src != ANY_SOURCE:
            self._check_peer(src, "src")
        _check_tag(tag, "tag", wildcard=True)
        limit = self._rt.timeout if timeout is None else config.timeout_s(timeout)
        deadline = time.monotonic() + limit
        what = f"probe(src={'ANY_SOURCE' if src == ANY_SOURCE else src}, tag={'ANY_TAG' if tag == ANY_TAG else tag})"
        check_at = time.monotonic() + _CHECK_S
        while True:
            seen = mailbox.doorbell(self._rt._ctrl, self._geo)
            with self._lock:
                self._rt._check_usable()
                self._advance()
                found = self._find(src, tag)
                if found is not None or not blocking:
                    return None if found is None else _status(found, None)
            if time.monotonic() >= min(check_at, deadline):
                self._check_waiting(what, deadline, limit, src)
                check_at = time.monotonic() + _CHECK_S
            mailbox.sleep_on_doorbell(self._rt._ctrl, self._geo, seen, self._sleep_ns(deadline), *self._wait)

    # --- the direct path (see the module doc) --------------------------------------------------
    def send_again(self, x: Any, dst: Any, tag: Any) -> bool:
        """The lean path of a blocking send: True if ``x`` went as the last direct send of the
        same array, peer, tag and dtype did (in one free slot, nothing before it); False: nothing
        was done."""
        m = self._send_lean
        # (``is`` on the ints: CPython keeps one object per small int; a miss costs only the
        # direct path's checks. No lock: send_at holds the gate, see _Guard.)
        if m is None or m[0] is not x or m[1] is not dst or m[2] is not tag or x.dtype is not m[3]:
            return False
        if self._rt._broken is not None:
            return False
        return bool(m[4](m[5]) == 1)

    def recv_again(self, buf: Any, src: Any, tag: Any) -> Status | None:
        """The lean path of a blocking receive: the Status of a message taken into ``buf`` as the
        last direct receive of the same buffer, source, tag and dtype took one, spinning for it
        as long as the collectives spin; None: nothing was taken (not such a call, nothing came
        yet, or the message is for the general path)."""
        m = self._recv_lean
        if m is None or m[0] is not buf or m[1] is not src or m[2] is not tag or buf.dtype is not m[3]:
            return None
        if not buf.flags.writeable or self._rt._broken is not None:
            return None
        got = m[4](m[5])  # (no lock: recv_at holds the gate, see _Guard)
        if got == mailbox.SAME_AS_LAST:
            return m[9]  # type: ignore[no-any-return]  # (a Status is a frozen dataclass: shared)
        if got < 0:
            return None
        st = m[9] = Status(src, int(m[8][1]), got // buf.itemsize, got)
        return st

    def send_now(self, x: np.ndarray, dst: Any, tag: Any) -> bool:
        """A blocking send of ``x`` written at once, if it fits in one free slot and nothing
        comes before it; False: nothing was done (the caller takes the general way)."""
        if type(dst) is not int or type(tag) is not int or not 0 <= dst < self._n or not 0 <= tag <= _MAX_TAG:
            return False
        code = DTYPE_CODE.get(x.dtype)
        if code is None or not x.flags.c_contiguous:
            return False
        payload = (x if x.ndim == 1 else x.reshape(-1)).view(np.uint8)
        with self._lock:
            if self._tracked or self._sends[dst] or payload.size > self._slot_bytes:
                return False
            self._rt._check_usable()
            msg_id = self._next_id.item(dst)
            sent = mailbox.push(self._rt._ctrl, self._data, self._geo, dst, payload, 0, msg_id, tag, payload.size, code)
            if sent != 1:  # no free slot: nothing was written
                return False
            self._next_id[dst] = msg_id + 1
            self._remember(0, x, payload, dst, tag, code)
        return True

    def _remember(self, which: int, a: np.ndarray, flat: np.ndarray, peer: int, tag: int, code: int) -> None:
        """(lock held) After a direct send (``which`` 0) or receive (1): the first time, note its
        array, peer, tag and dtype; made again with the same ones, give it the lean path's memo
        (:meth:`send_again`, :meth:`recv_again`): the identity it is tested by, the entry point,
        the record's address, and what the record points into (kept alive here). Only at the
        second call, as the collectives' lean records: a record costs a few microseconds (numpy's
        ``ctypes.data``), which a program sending a new array every time must not pay. A lean
        call that waited past its spin ends on the direct path and keeps its memo."""
        dtype = a.dtype
        lean = self._send_lean if which == 0 else self._recv_lean
        if lean is not None and lean[0] is a and lean[1] is peer and lean[2] is tag and lean[3] is dtype:
            return
        last = self._send_seen if which == 0 else self._recv_seen
        if last is None or last[0] is not a or last[1] is not peer or last[2] is not tag or last[3] is not dtype:
            if which == 0:
                self._send_seen = (a, peer, tag, dtype)
            else:
                self._recv_seen = (a, peer, tag, dtype)
            return
        entries = mailbox.lean_entries()
        if entries is None:
            return
        header = np.zeros(4, np.int64)
        rt, gate = self._rt, self._lock.gate
        rec = mailbox.lean_record(
            rt._ctrl, self._data, self._geo, gate, flat, peer, tag, code, self._next_id, header, *self._wait
        )
        memo = [a, peer, tag, a.dtype, entries[which], int(rec.ctypes.data), rec, flat, header, None]
        self._lock.gate_now(entries)
        if which == 0:
            self._send_lean = memo
        else:
            self._recv_lean = memo

    def recv_now(self, buf: np.ndarray, src: Any, tag: Any, timeout: float | None) -> Status | None:
        """A blocking receive into ``buf`` from ``src`` that takes the message straight from the
        mailbox, waiting for it if need be; None: nothing was taken (the general way)."""
        if type(src) is not int or type(tag) is not int or not 0 <= src < self._n:
            return None
        if not (tag == ANY_TAG or 0 <= tag <= _MAX_TAG):
            return None
        code = DTYPE_CODE.get(buf.dtype)
        f = buf.flags
        if code is None or not (f.c_contiguous and f.writeable):
            return None
        out = (buf if buf.ndim == 1 else buf.reshape(-1)).view(np.uint8)
        ctrl, geo, header = self._rt._ctrl, self._geo, self._header
        started = check_at = 0.0
        while True:
            seen = mailbox.doorbell(ctrl, geo)
            with self._lock:
                self._rt._check_usable()
                if (
                    self._tracked
                    or self._posted
                    or self._current[src] is not None
                    or any(m.src == src for m in self._unexpected)
                ):
                    return None
                got = int(mailbox.take(ctrl, self._data, geo, src, tag, code, out, header))
                got_tag = int(header[1])  # (the header array is shared: read under the lock)
                if got >= 0 and out.size <= self._slot_bytes:
                    self._remember(1, buf, out, src, tag, code)
            if got >= 0:
                return Status(src, got_tag, got // buf.itemsize, got)
            if got == -2:
                return None
            limit = self._rt.timeout if timeout is None else timeout
            if not started:
                started = time.monotonic()
                check_at = started + _CHECK_S
            elif time.monotonic() >= min(check_at, started + limit):
                what = f"recv(src={src}, tag={'ANY_TAG' if tag == ANY_TAG else tag})"
                self._check_waiting(what, started + limit, limit, src)
                check_at = time.monotonic() + _CHECK_S
            mailbox.sleep_on_doorbell(ctrl, geo, seen, self._sleep_ns(started + limit), *self._wait)

    # --- requests (Request.wait / test call these through the queue protocol) -----------------
    def wait_for(self, req: Request, timeout: float | None) -> None:
        limit = self._rt.timeout if req._timeout is None else req._timeout
        started = time.monotonic()
        stop_waiting = None if timeout is None else started + timeout
        check_at = started + _CHECK_S
        while req._state != _DONE:
            seen = mailbox.doorbell(self._rt._ctrl, self._geo)
            with self._lock:
                if req._state == _DONE:
                    break
                self._advance()
                if req._state == _DONE:
                    break
            if stop_waiting is not None and time.monotonic() > stop_waiting:
                raise TimeoutError(f"{req.what} has not completed after {timeout:g}s; it goes on: wait again later")
            if time.monotonic() >= min(check_at, started + limit):
                self._check_waiting(req.what, started + limit, limit, _peer_of(req))
                check_at = time.monotonic() + _CHECK_S
            wake_at = started + limit if stop_waiting is None else min(started + limit, stop_waiting)
            mailbox.sleep_on_doorbell(self._rt._ctrl, self._geo, seen, self._sleep_ns(wake_at), *self._wait)

    def _track(self, req: Request, blocking: bool) -> None:
        """(lock held) Count a nonblocking operation, and start the thread that moves them."""
        if blocking or req._state == _DONE:
            return
        self._tracked.add(req)
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name=f"shmcoll-p2p-r{self._rt.rank}", daemon=True)
            self._thread.start()
        else:
            self._wake.notify()

    def _complete(self, req: Request, result: Any = None, error: BaseException | None = None) -> None:
        """(lock held) Finish a request."""
        if req._state == _DONE:
            return
        req._result, req._error = result, error
        req._state = _DONE
        self._tracked.discard(req)
        if _ANY_WAITERS[0]:
            with _ANY_DONE:
                _ANY_DONE.notify_all()

    def _serve(self) -> None:
        """Move nonblocking operations while the caller does something else."""
        while True:
            with self._lock:
                while not self._tracked and not self._stopping:
                    self._wake.wait()
                if self._stopping and not self._tracked:
                    return
            seen = mailbox.doorbell(self._rt._ctrl, self._geo)
            with self._lock:
                self._advance()
                if not self._tracked:
                    continue
            try:
                self._check_waiting("a nonblocking point-to-point operation", float("inf"), float("inf"), ANY_SOURCE)
            except BaseException as exc:  # noqa: BLE001  (every pending operation fails with it)
                self._fail_all(exc)
                continue
            # (no spin: this thread runs beside the caller's work, which needs the core)
            mailbox.sleep_on_doorbell(self._rt._ctrl, self._geo, seen, _SLEEP_NS, 0, 0)

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            for q in self._sends:
                while q:
                    self._complete(q.popleft().req, error=exc)
            for r in self._posted:
                self._complete(r.req, error=exc)
            self._posted.clear()
            for m in self._current:
                if m is not None and m.recv is not None:
                    self._complete(m.recv.req, error=exc)

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._wake.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    # --- matching -----------------------------------------------------------------------------
    def _post(self, r: _Receive) -> None:
        """(lock held) Give ``r`` the earliest matching message that arrived, else post it."""
        for m in self._unexpected:
            if m.recv is None and r.matches(m.src, m.tag):
                if self._fits(r, m):
                    m.recv = r
                    if m.complete:
                        self._deliver(m)
                return
        self._posted.append(r)

    def _fits(self, r: _Receive, m: _Message) -> bool:
        """Whether ``m`` can go into ``r``'s buffer; else fail ``r`` (the message stays)."""
        if r.allocate:  # recv_object: only an object will do
            if m.dtype == _OBJECT_DTYPE:
                return True
            self._complete(
                r.req,
                error=TypeError(
                    f"rank {self._rt.rank}: {r.req.what}: rank {m.src} sent an array of {dtype_name(m.dtype)} "
                    f"(tag {m.tag}), not an object (send_object); the message stays, to be received with recv"
                ),
            )
            return False
        assert r.out is not None and r.dtype is not None
        if m.dtype != DTYPE_CODE.get(r.dtype, -1):
            sent = "bytes of an object" if m.dtype == _OBJECT_DTYPE else dtype_name(m.dtype)
            self._complete(
                r.req,
                error=TypeError(
                    f"rank {self._rt.rank}: {r.req.what}: rank {m.src} sent {sent} (tag {m.tag}), the buffer is "
                    f"{dtype_str(r.dtype)}; the message stays, to be received into a buffer of its dtype"
                ),
            )
            return False
        if m.nbytes > r.out.size:
            self._complete(
                r.req,
                error=ValueError(
                    f"rank {self._rt.rank}: {r.req.what}: the message from rank {m.src} (tag {m.tag}) has "
                    f"{m.nbytes:,} bytes, the buffer holds {r.out.size:,}; the message stays, to be received "
                    f"into a buffer that fits"
                ),
            )
            return False
        return True

    def _deliver(self, m: _Message) -> None:
        """(lock held) Complete the receive of a whole message."""
        r = m.recv
        assert r is not None
        if m in self._unexpected:
            self._unexpected.remove(m)
        if r.allocate:
            result: Any = (m.buf, _status(m, None))
        else:
            assert r.out is not None
            if m.buf is not r.out and m.nbytes:
                r.out[: m.nbytes] = m.buf[: m.nbytes]
            result = _status(m, r.dtype)
        self._complete(r.req, result=result)

    def _find(self, src: int, tag: int) -> _Message | None:
        """(lock held) The earliest arrived message matching (src, tag) that no receive took."""
        for m in self._unexpected:
            if m.recv is None and (src == ANY_SOURCE or m.src == src) and (tag == ANY_TAG or m.tag == tag):
                return m
        return None

    def _advance(self) -> bool:
        """(lock held) Move every outstanding message as far as it goes now."""
        ctrl, geo, data = self._rt._ctrl, self._geo, self._data
        moved = False
        for dst in range(self._n):
            q = self._sends[dst]
            while q:
                s = q[0]
                sent = int(mailbox.push(ctrl, data, geo, dst, s.payload, s.sent, s.msg_id, s.tag, s.nbytes, s.dtype))
                moved = moved or sent != s.sent
                s.sent = sent
                if sent < s.total:
                    break
                q.popleft()
                self._complete(s.req)
        while True:  # passes over the senders, one message each, until nothing more has arrived
            moved_now = False
            for k in range(self._n):
                moved_now = self._drain((self._turn + k) % self._n) or moved_now
            self._turn = (self._turn + 1) % self._n
            if not moved_now:
                return moved
            moved = True

    def _drain(self, src: int) -> bool:
        """(lock held) Take in what arrived from ``src``: the rest of the message in flight, or
        one new message. One per pass, whatever the sender keeps sending: the callers serve the
        senders in turn, so no sender can starve the others."""
        ctrl, geo = self._rt._ctrl, self._geo
        m = self._current[src]
        if m is None:
            if not mailbox.peek(ctrl, geo, src, self._header):
                return False
            self._order += 1
            m = _Message(src, self._header, self._order, int(mailbox.fragments(geo, int(self._header[2]))))
            for r in self._posted:
                if r.matches(src, m.tag):
                    self._posted.remove(r)
                    if self._fits(r, m):
                        m.recv = r
                    break
            if m.recv is not None and not m.recv.allocate:
                m.buf = m.recv.out  # type: ignore[assignment]
            else:
                m.buf = np.empty(m.nbytes, np.uint8)
                if m.recv is None:
                    self._unexpected.append(m)
            self._current[src] = m
        got = int(mailbox.pull(ctrl, self._data, geo, src, m.buf, m.got, m.msg_id, m.nbytes))
        if got < 0:
            raise RuntimeError(f"rank {self._rt.rank}: mailbox from rank {src} out of order (message {m.msg_id})")
        moved = got != m.got or m.got == 0
        m.got = got
        if m.complete:
            self._current[src] = None
            if m.recv is not None:
                self._deliver(m)
        return moved

    # --- failing ------------------------------------------------------------------------------
    def _check_waiting(self, what: str, deadline: float, limit: float, peer: int) -> None:
        """Raise (breaking the communicator) if waiting is over: an abort, a lost peer, the deadline."""
        rt = self._rt
        if rt._broken is not None:
            rt._check_usable()
        if rt._arena.word(layout.AB_CODE) != 0:
            info = rt._arena.abort_info()
            rt._broken = f"rank {rt.rank}: {what}: the communicator was aborted (by rank {info['origin']})"
            rt._check_usable()
        peers = range(self._n) if peer == ANY_SOURCE else (peer,)
        for p in peers:
            if p == rt.rank:
                continue
            status = rt._arena.peer_status(p)
            if status in ("dead", "failed") or (status == "exited" and peer != ANY_SOURCE):
                if p not in self._gone:
                    # What the peer sent before it left is still there, and the caller looks for
                    # it once more before the peer counts as lost: a receive that looked just
                    # before the message came, and at its sender just after it closed, raised
                    # "lost (exited)" with the message there.
                    self._gone.add(p)
                    continue
                msg = f"rank {rt.rank}: {what}: peer rank {p} was lost ({status})"
                rt._arena.abort(rt.rank, layout.ABORT_PEER_LOST, p)
                rt._broken = msg
                raise PeerLostError(msg, dead_rank=p)
        if time.monotonic() > deadline:
            pending = ", ".join(
                f"from rank {m.src} tag {m.tag} ({m.nbytes:,} bytes)" for m in self._unexpected if m.recv is None
            )
            msg = f"rank {rt.rank}: {what} timed out after {limit:g}s with no matching message" + (
                f"; arrived but not matching: {pending}" if pending else "; nothing else arrived either"
            )
            rt._arena.abort(rt.rank, layout.ABORT_TIMEOUT, -1)
            rt._broken = msg
            raise CollectiveTimeout(msg)

    def _sleep_ns(self, until: float) -> int:
        return int(max(1e3, min(_SLEEP_NS, (until - time.monotonic()) * 1e9)))

    # --- arguments ----------------------------------------------------------------------------
    def _payload(self, a: Any, name: str, written: bool = False) -> tuple[np.ndarray, int]:
        """A flat byte view of a numpy array (or anything ``bind`` accepted), and its dtype code."""
        if not isinstance(a, np.ndarray):
            raise arrays.not_array(name, a)
        if written:
            arrays.check_written(a, name)
        else:
            arrays.check_read(a, name)
        arrays.check_dtype(a.dtype)
        flat = a.reshape(-1) if a.ndim != 1 else a
        return flat.view(np.uint8), DTYPE_CODE[a.dtype]

    def _quiet(self) -> bool:
        """(lock held) Nothing pending that a lean call could pass: see ``mailbox``'s gate."""
        if self._tracked or self._posted or self._unexpected or any(self._sends):
            return False
        return self._current.count(None) == self._n

    def _check_peer(self, peer: Any, name: str) -> None:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self._n:
            raise ValueError(f"{name}={peer!r} out of range for world_size {self._n}")


class _Guard:
    """A PointToPoint's lock: a Python lock for its threads and, once the lean path exists (the
    first lean memo: :meth:`gate_now`), the gate (``mailbox.hold_at``) that lean calls take instead
    of the Python lock. Held, both are; let go, the gate learns whether the state is quiet
    (:meth:`PointToPoint._quiet`), which a lean call needs to run at all. Until a lean memo
    exists no lean call can run, so a program that never repeats its arrays does not pay for the
    gate (two compiled calls and the quiet check: 0.5 us per hold). A ``threading.Condition``
    takes it as its lock (waiting lets go of both)."""

    def __init__(self, p2p: PointToPoint) -> None:
        self._p2p = p2p
        self._lock = threading.Lock()
        self.gate = np.zeros(2, np.int64)
        self.gate[mailbox.GATE_QUIET] = 1
        self._address = int(self.gate.ctypes.data)
        self._entries: Any = None  # (hold_at, let_go_at) once gating
        self._gated = False  # whether the holder holds the gate too

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        entries = self._entries
        if entries is not None:
            if not entries[0](self._address, 1 if blocking else 0):  # (a lean call holds it for one call)
                self._lock.release()
                return False
            self._gated = True
        return True

    __enter__ = acquire

    def gate_now(self, entries: Any) -> None:
        """(lock held) From now on every holder holds the gate too: before the first lean memo
        is published."""
        if self._entries is None:
            entries[2](self._address, 1)
            self._gated = True
            self._entries = (entries[2], entries[3])

    def release(self, *exc: object) -> None:
        if self._gated:
            self._gated = False
            self._entries[1](self._address, 1 if self._p2p._quiet() else 0)
        self._lock.release()

    __exit__ = release  # (not a method calling release: a frame less per hold)


def _check_tag(tag: Any, name: str, wildcard: bool) -> None:
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {tag!r}")
    if (tag == ANY_TAG and wildcard) or 0 <= tag <= _MAX_TAG:
        return
    raise ValueError(f"{name} must be >= 0{' (or ANY_TAG)' if wildcard else ''}, got {tag}")


def _status(m: _Message, dtype: np.dtype | None) -> Status:
    if dtype is None:
        dtype = np.dtype(np.uint8) if m.dtype >= len(DTYPES) else DTYPES[m.dtype]
    itemsize = dtype.itemsize
    return Status(m.src, m.tag, m.nbytes // itemsize, m.nbytes)


def _peer_of(req: Request) -> int:
    what = req.what
    for key in ("dst=", "src="):
        if key in what:
            text = what.split(key, 1)[1].split(",", 1)[0]
            return ANY_SOURCE if text == "ANY_SOURCE" else int(text)
    return ANY_SOURCE


__all__ = ["ANY_SOURCE", "ANY_TAG", "OBJECT_DTYPE", "PointToPoint", "Status"]
OBJECT_DTYPE = _OBJECT_DTYPE
