"""Where everything lives in a communicator's arena: pure offset arithmetic, no memory access.

One arena per communicator. Every control word is a monotonic int64 counter (never a 0/1 flag
reset in a careful order), and words written by different processes never share a 64-byte line,
so a rank polling its own word never steals a line another rank is writing::

    byte 0    +--------------------------------------------------------------------+
              | header     MAGIC VERSION TOKEN WORLD_SIZE NSLOTS SLOT_BYTES TOTAL   |  line 0
              | attach     ATTACHED (fetch_add at connect)  DETACHED  GROUP_SIZE     |  line 1
              |            CMA_BLOCK_NS                                            |
              | abort      CODE ORIGIN PEER SEQ SIG STEP DETAIL OWN_SEQ             |  line 2
    192       +--------------------------------------------------------------------+
              | rank r     PID START STATE CUR_SEQ CUR_SIG CUR_STEP DONE_SEQ DONE_SIG|  2 lines
              |            WAIT_PEER (written only by rank r; read by others on      |  per rank
              |            errors)                                                 |
              +--------------------------------------------------------------------+
              | live r     robust pthread mutex, held by rank r while connected     |  1 line
              |            (the kernel marks it OWNER_DIED if r dies: shm/liveness)  |  per rank
              +--------------------------------------------------------------------+
              | channel c  producer line: HEAD          TAIL_SEEN                   |  3 lines
              |            consumer line: TAIL                                     |  per channel
              |            waiters line:  HEAD_WAITERS  TAIL_WAITERS                |
              +--------------------------------------------------------------------+
              | ring c     (NSLOTS + 1) slot strides of 64-byte cells; a message is  |  one ring
              |            SEQ SIG PLACE MSG (32 B) + payload, on whole cells       |  per channel
              +--------------------------------------------------------------------+
              | mailbox m  producer line / consumer line, as a channel's            |  2 lines per
              |            (m = src * n + dst: point-to-point, self included)       |  mailbox
              +--------------------------------------------------------------------+
              | doorbell r DOORBELL  DOORBELL_WAITERS                               |  1 line
              |            (rung by whoever fills or frees rank r's mailboxes)      |  per rank
              +--------------------------------------------------------------------+
              | mail ring  MAIL_NSLOTS slots: ID TAG NBYTES DTYPE (32 B) + payload  |  per mailbox
              +--------------------------------------------------------------------+ TOTAL

A channel is one directed single-producer single-consumer queue ``src -> dst``; there are
``world_size * (world_size - 1)`` of them. Its ring is counted in 64-byte **cells**, and a
message takes as many whole cells as its header and payload need: one for a payload of up to
32 bytes, a slot stride (``round64(32 + SLOT_BYTES)``) for a full piece. The producer owns HEAD
(cells published: where the next message goes) and the consumer owns TAIL (cells consumed);
position ``k`` is cell ``k % RING_CELLS``. Counting cells instead of fixed slots lets a root
run thousands of small messages ahead of ranks that are switched out (4 ranks sharing 2 cores:
an 8-byte broadcast 3.5 -> 1.3 us per call) while a large piece still takes a whole stride:

- a message never wraps: one that does not fit before the ring's end starts the next lap, and
  the cell where it would have started gets only MSG, a **skip**, which the consumer recognises
  because the message's end lies beyond the ring's end from there;
- MSG, stored last, is the message's *end* (the HEAD it publishes). Before storing it the
  producer zeroes the MSG word of the cell at that end, where the next message will start, so a
  consumer that polls there never reads an earlier lap's payload as a header; the producer
  therefore keeps one free cell beyond every message (``end - TAIL < RING_CELLS``);
- the ring is one stride longer than NSLOTS strides, so that NSLOTS full pieces always fit
  together whatever the wrap wastes: the plans are verified against channels of NSLOTS
  messages (``plan/verify``), and smaller messages only add room.

A stream of messages should move only the message cells' lines between the two caches (a line
moved costs ~0.1 us here, most of a small call's hand-off):

- the consumer spins on its next cell's MSG, which shares its line with the header and a
  payload of up to 32 bytes; HEAD is what a consumer that has stopped spinning sleeps on (its
  futex);
- the producer keeps the TAIL it last read in TAIL_SEEN, on its own line, and reads the
  consumer's line again only when the ring looks full by that value;
- a sleeper counts itself in a waiters word, on a line of its own that only sleepers write, so a
  publisher's check for sleepers reads a line that is in its cache.

Each message starts with the SEQ and SIG of the call that wrote it, so a receiver detects a peer
that is in a different call (mismatch) on first contact, and PLACE, where a zero-copy call's
registered buffer sits (0 otherwise), so ranks that passed buffers from different places are
caught before anyone reads a peer's buffer. A payload of up to 32 bytes shares the cache line of
its tag, so a small message costs the consumer one line.

The liveness lines are never written while their ranks live, so every rank can read all of
them at the start of each call from its own cache.

Point-to-point messages travel in **mailboxes**, apart from the collectives' channels, so that
tags, wildcard receives and probes never see collective traffic (``engine/mailbox.py``): every
slot of a message carries the message's id (counting per mailbox), tag, size and dtype, and a
receiver sleeps on its **doorbell**, which senders ring after filling and receivers after
freeing slots, instead of on one channel.

Footprint: ``192 + 256 n + 192 n (n - 1) + 128 n^2 + n (n - 1) (NSLOTS + 1) S + n^2 MAIL_NSLOTS S``
bytes for ``n`` ranks, ``S = round64(32 + SLOT_BYTES)`` and ``MAIL_NSLOTS = min(NSLOTS, 2)``; with
the defaults (4 slots of 64 KiB) that is 1.1 MiB for 2 ranks, 5.8 MiB for 4, 25.5 MiB for 8.
Only the cells a call's messages reach are ever touched (tmpfs pages appear on first touch).
"""

from __future__ import annotations

import dataclasses

LINE = 64
WORDS_PER_LINE = LINE // 8
CELL = LINE  # a ring's unit: a message takes whole cells
MAGIC = 0x6C6C6F636D687300  # "\0shmcoll" little endian: a header that is not ours fails fast
VERSION = 6  # 2: A_GROUP_SIZE; 3: rank records with WAIT_PEER, liveness lines; 4: mailboxes; 5: 3-line channels, MSG;
# 6: rings of cells. (A_CMA_CROSSOVER took a word of line 1 that 6 left zero and moved nothing, so
# the version, which tune tables record to be judged by, stays.)
SLOT_HEADER_BYTES = 32

# Header words (int64 index).
H_MAGIC, H_VERSION, H_TOKEN, H_WORLD_SIZE, H_NSLOTS, H_SLOT_BYTES, H_TOTAL = range(7)
A_ATTACHED = 8  # line 1
A_DETACHED = 9
A_GROUP_SIZE = 10  # ranks per group for hierarchical plans, set by the first rank to need it (0: not yet)
# shm.cma.crossover_bytes as the launcher, or else the first rank to need it, measured it (0: not
# yet; CMA_MEASURING: a rank is measuring it)
A_CMA_CROSSOVER = 11
CMA_MEASURING = -1
# Abort line (line 2): the first failing rank fills it, then publishes CODE last.
AB_CODE = 16
AB_ORIGIN = 17
AB_PEER = 18
AB_SEQ = 19
AB_SIG = 20
AB_STEP = 21
AB_DETAIL = 22  # mismatch: the origin's own signature for the compared call
AB_OWN_SEQ = 23  # mismatch: the origin's own number for the compared call
RANKS_BASE_WORD = 24
RANK_WORDS = 2 * WORDS_PER_LINE
# Rank record fields (offsets within the rank's record).
R_PID, R_START, R_STATE, R_CUR_SEQ, R_CUR_SIG, R_CUR_STEP, R_DONE_SEQ, R_DONE_SIG = range(8)
R_WAIT_PEER = WORDS_PER_LINE  # the peer a waiting call waits for (-1: none), on the record's 2nd line
# Where a cross-memory-attach call's input and output start in the rank's own address space,
# published when it enters the call (peers read them after the call's first sync).
R_IN_ADDR = WORDS_PER_LINE + 1
R_OUT_ADDR = WORDS_PER_LINE + 2
R_COMPILING = WORDS_PER_LINE + 3  # 1 while the rank compiles kernels (its peers' waits do not time out)
# 2k + 1 where the rank's buffers were on huge pages at its k-th call whose choice hinges on pages,
# 2k where not (comm.pages); 0: none yet. (A word 6 left zero: nothing moved, the version stays.)
R_PAGES = WORDS_PER_LINE + 4
R_PAGES_WAITERS = WORDS_PER_LINE + 5  # ranks sleeping on R_PAGES (its futex)
# 1 where the leader of a timed call shape last voted for cma by its times (comm.timed), else 0:
# what its peers follow. Apart from R_PAGES, whose parity also says where a page-aware timed
# shape's leader voted for its pages.
R_TIMED = WORDS_PER_LINE + 6
# Rank states.
STATE_IDLE, STATE_IN_CALL, STATE_FAILED, STATE_EXITED = range(4)
# Abort codes: why a communicator is broken (0: it is not).
ABORT_USER = 1
ABORT_TIMEOUT = 2
ABORT_PEER_LOST = 3
ABORT_MISMATCH = 4
ABORT_ERROR = 5
# The origin's multi-node communicator failed (over MPI, or on another node): PEER holds the world
# rank it blames (-1: none), DETAIL the kind (REMOTE_LOST, REMOTE_TIMEOUT, REMOTE_BROKEN). Its node
# peers read that story here even after the origin has exited, when its MPI notice may be lost.
ABORT_REMOTE = 6
REMOTE_LOST, REMOTE_TIMEOUT, REMOTE_BROKEN = 1, 2, 3
# Channel control fields (offsets from the channel's first word): three lines, so that in a
# steady stream of messages neither side reads a line the other writes, but for the cells'.
C_HEAD = 0  # producer line: cells published (a mailbox's: messages)
C_TAIL_SEEN = 1  # producer line: TAIL as the producer last read it (see the module doc)
C_TAIL = WORDS_PER_LINE  # consumer line: cells consumed (a mailbox's: messages)
C_HEAD_WAITERS = 2 * WORDS_PER_LINE  # waiters line: written only around a sleep
C_TAIL_WAITERS = 2 * WORDS_PER_LINE + 1
CHANNEL_WORDS = 3 * WORDS_PER_LINE
MAILBOX_WORDS = 2 * WORDS_PER_LINE  # a mailbox's HEAD and TAIL lines (its sleepers use doorbells)
# Message header words: the call's SEQ and SIG, PLACE, and MSG, the message's end in its
# channel (HEAD once it is published), stored last: the consumer polls it.
SLOT_SEQ, SLOT_SIG, SLOT_PLACE, SLOT_MSG = range(4)
# Doorbell fields (offsets within a rank's doorbell line).
D_DOORBELL = 0
D_WAITERS = 1
# Mailbox slot header (int64 words): the message's id in its mailbox, tag, bytes, dtype code.
M_ID, M_TAG, M_NBYTES, M_DTYPE = range(4)
MAIL_NSLOTS_MAX = 2


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclasses.dataclass(frozen=True)
class Layout:
    """The arena geometry for ``world_size`` ranks, ``nslots`` slots of ``slot_bytes`` each."""

    world_size: int
    nslots: int
    slot_bytes: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.nslots < 1:
            raise ValueError(f"nslots must be >= 1, got {self.nslots}")
        if self.slot_bytes < 64 or self.slot_bytes % 64:
            raise ValueError(f"slot_bytes must be a multiple of 64, >= 64; got {self.slot_bytes}")

    @property
    def nchannels(self) -> int:
        return self.world_size * (self.world_size - 1)

    @property
    def live_base_word(self) -> int:
        return RANKS_BASE_WORD + self.world_size * RANK_WORDS

    @property
    def channels_base_word(self) -> int:
        return self.live_base_word + self.world_size * WORDS_PER_LINE

    @property
    def slot_stride(self) -> int:
        return round_up(SLOT_HEADER_BYTES + self.slot_bytes, LINE)

    @property
    def ring_bytes(self) -> int:
        # One stride more than NSLOTS: NSLOTS full pieces fit whatever a wrap wastes (module doc).
        return (self.nslots + 1) * self.slot_stride

    @property
    def ring_cells(self) -> int:
        return self.ring_bytes // CELL

    @property
    def rings_base(self) -> int:
        return (self.channels_base_word + self.nchannels * CHANNEL_WORDS) * 8

    @property
    def mail_base_word(self) -> int:
        return (self.rings_base + self.nchannels * self.ring_bytes) // 8

    @property
    def nmailboxes(self) -> int:
        return self.world_size * self.world_size

    @property
    def doorbell_base_word(self) -> int:
        return self.mail_base_word + self.nmailboxes * MAILBOX_WORDS

    @property
    def mail_nslots(self) -> int:
        return min(self.nslots, MAIL_NSLOTS_MAX)

    @property
    def mail_ring_bytes(self) -> int:
        return self.mail_nslots * self.slot_stride

    @property
    def mail_slots_base(self) -> int:
        return (self.doorbell_base_word + self.world_size * WORDS_PER_LINE) * 8

    @property
    def total_bytes(self) -> int:
        return self.mail_slots_base + self.nmailboxes * self.mail_ring_bytes

    def mailbox(self, src: int, dst: int) -> int:
        """Index of the mailbox ``src -> dst`` (``src == dst``: a rank's messages to itself)."""
        if not (0 <= src < self.world_size and 0 <= dst < self.world_size):
            raise ValueError(f"no mailbox {src} -> {dst} among {self.world_size} ranks")
        return src * self.world_size + dst

    def mailbox_word(self, mailbox: int, field: int) -> int:
        return self.mail_base_word + mailbox * MAILBOX_WORDS + field

    def doorbell_word(self, rank: int) -> int:
        return self.doorbell_base_word + rank * WORDS_PER_LINE

    def rank_word(self, rank: int, field: int) -> int:
        return RANKS_BASE_WORD + rank * RANK_WORDS + field

    def live_word(self, rank: int) -> int:
        """The first word of ``rank``'s liveness line (its mutex; the lock word is the low half)."""
        return self.live_base_word + rank * WORDS_PER_LINE

    def channel(self, src: int, dst: int) -> int:
        """Index of the directed channel ``src -> dst``."""
        if src == dst or not (0 <= src < self.world_size and 0 <= dst < self.world_size):
            raise ValueError(f"no channel {src} -> {dst} among {self.world_size} ranks")
        return src * (self.world_size - 1) + (dst if dst < src else dst - 1)

    def channel_word(self, channel: int, field: int) -> int:
        return self.channels_base_word + channel * CHANNEL_WORDS + field

    def cell_offset(self, channel: int, index: int) -> int:
        """Byte offset of cell ``index`` (0 <= index < ring_cells) of ``channel``'s ring."""
        return self.rings_base + channel * self.ring_bytes + index * CELL


def footprint_bytes(world_size: int, nslots: int, slot_bytes: int) -> int:
    """Shared-memory bytes of one communicator's arena (the formula in this module's doc)."""
    return Layout(world_size, nslots, slot_bytes).total_bytes
