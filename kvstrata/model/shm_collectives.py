"""The model's all-reduce and all-gather through shared memory, between the tensor-parallel ranks of one machine.

gloo moves a decode row over loopback TCP (~200-300 us a call on CPU); here every rank copies its chunk into
its slot of one segment, tells each peer it is there, and reads the others' slots itself. One segment per
tensor-parallel group, created by rank 0 under a name unique to the server, mapped by every rank, then
unlinked at once (a crash later leaves nothing in /dev/shm):

    | header (magic) | sem[r][j], one 64-byte line each: j -> r "round k is in my slot" | slots[2][size] |

One round moves a chunk of at most SLOT_BYTES per rank, in slots[k % 2]:

    rank j: copy its chunk into slots[k % 2][j]; post sem[r][j] for every peer r     (release)
            wait sem[j][r] for every peer r                                         (acquire)
            read slots[k % 2][0 .. size-1] in rank order (sum them, or place them side by side)

POSIX semaphores order memory (a post happens-before the wait it satisfies), so the slot a peer wrote before
its post is complete when the wait returns. One signal per round is enough with two buffers: a rank writes
slots[k % 2] again at round k + 2, after every peer posted round k + 1, which each does after reading round
k. A pair's semaphore holds at most two posts, one per round in flight, so it never confuses rounds.

Sums are in rank order (float32 accumulation for 16-bit floats, one rounding at the end) and every rank
computes the same sum, so all ranks hold the same bits and deterministic mode stays deterministic; with two
ranks this is bit for bit gloo's sum. A wait checks the peer it waits on every LIVENESS_S: a peer that exited
fails the call at once, one that hangs after `timeout_s` (ShmCollectiveError; TensorParallel makes it the
server's RankFailure).

The plans' broadcasts take the same rounds (only the source publishes; the others arrive and copy its slot).
Where the CPU kernel library is built, a round's publish, posts and polling, and an all-reduce's sum, run in
one compiled op each (csrc/shm_collectives.cpp); the code below is their plain-torch twin and the sleeping
wait. In a decode step on the bench model (18 all-reduces, two plan broadcasts) that took rank 0's step from
11.4 to 9.6-9.9 ms: the Python round costs ~70 us on caches a layer's GEMVs just evicted, gloo's broadcast ~200.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import secrets
import time
from typing import Optional

import torch
import torch.distributed as dist

from kvstrata.model import paged_kernels

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "kvstrata-tp-"        # + rank 0's pid + a random token: one segment per server
NAME_BYTES = 64
MAGIC = 0x6B76_7370_7368_6D31       # "kvspshm1": checked by every rank that maps the segment
SLOT_BYTES = 1 << 20                # per rank and buffer: 2 ranks map 4 MiB, 8 ranks 16 MiB
LINE = 64
SEM_T_BYTES = 32                    # glibc's sem_t on 64-bit Linux (fits one line)
# Poll a semaphore this long before sleeping on it: within a forward the peer comes within one layer's skew,
# while a sleeping rank's wake-up waits for its core on a busy machine (decode, 2 ranks, load 9: 20 us of
# polling gave 14.8 tok/s, gloo 40.5, 5 ms 102.9).
SPIN_S = 5e-3
COMPILED_SUM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # summed by the compiled op; others here
LIVENESS_S = 0.1                    # a sleeping wait wakes this often to check the peer it waits on
CLOCK_MONOTONIC = 1


class ShmCollectiveError(RuntimeError):
    """A peer rank exited or did not arrive within the timeout."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)   # CDLL calls release the GIL while they block
    for name in ("sem_init", "sem_post", "sem_trywait", "sem_timedwait"):
        getattr(libc, name).restype = ctypes.c_int
    return libc


class ShmCollectives:
    """One rank's side of the group's segment: `all_reduce` and `all_gather` with every rank of the group.

    Every rank must make the same calls with the same shapes, in the same order (as with torch.distributed).
    """

    def __init__(self, rank: int, size: int, mm: mmap.mmap, peer_pids: list[int], timeout_s: float,
                 name: str, compiled: bool = True):
        self.rank, self.size = rank, size
        self.name = name
        self.timeout_s = timeout_s
        self.peer_pids = peer_pids
        self._mm = mm
        self._raw = torch.frombuffer(mm, dtype=torch.uint8)
        base = self._raw.data_ptr()
        self._sems = [[ctypes.c_void_p(base + _sem_offset(size, r, j)) for j in range(size)] for r in range(size)]
        slots0 = _slots_offset(size)
        self._slots = [[self._raw[slots0 + (b * size + j) * SLOT_BYTES:][:SLOT_BYTES] for j in range(size)]
                       for b in range(2)]
        self._round = 0
        self._scratch = torch.empty(SLOT_BYTES // 2, dtype=torch.float32)   # 16-bit sums accumulate here
        self._libc = _libc()
        self._clockwait = getattr(self._libc, "sem_clockwait", None)        # glibc >= 2.30
        # The compiled poll and sum (csrc/shm_collectives.cpp), or None: the plain-torch path below.
        self.ops = paged_kernels.shm_ops() if compiled else None
        self._sems_base = base + _sem_offset(size, 0, 0)
        self._slot_base = [base + slots0 + b * size * SLOT_BYTES for b in range(2)]

    @classmethod
    def join(cls, rank: int, size: int, group: dist.ProcessGroup, timeout_s: float,
             compiled: bool = True) -> Optional[ShmCollectives]:
        """Map the group's segment (rank 0 creates it; the name travels over `group`), or None on every
        rank when any rank cannot (no /dev/shm, too little space): the caller keeps torch.distributed.
        `compiled`: poll and sum with the CPU kernel library's ops where it is built."""
        name, mm = _create(size) if rank == 0 else ("", None)
        try:
            name = _broadcast_name(name, group)
            if rank != 0 and name:
                mm = _attach(name, size, rank)
            flags = torch.tensor([int(mm is not None), os.getpid()], dtype=torch.long)
            everyone = [torch.empty_like(flags) for _ in range(size)]
            dist.all_gather(everyone, flags, group=group)       # also: every rank has mapped it (or failed)
        finally:
            if rank == 0 and name:
                _unlink(name)
        dist.barrier(group=group)       # on return, on every rank, the name is gone
        if not all(int(f[0]) for f in everyone):
            if mm is not None:
                mm.close()
            return None
        return cls(rank, size, mm, [int(f[1]) for f in everyone], timeout_s, name, compiled)

    def close(self) -> None:
        """Unmap the segment (its name is gone already)."""
        self._slots, self._raw = [], None
        try:
            self._mm.close()
        except BufferError:     # a view still exported: the mapping goes with the process
            pass

    def all_reduce(self, x: torch.Tensor) -> None:
        """Sum `x` over the ranks in place, in rank order; every rank ends with the same bits."""
        compiled = self.ops is not None and x.dtype in COMPILED_SUM_DTYPES
        if compiled and x.is_contiguous() and x.numel() * x.element_size() <= SLOT_BYTES:
            self._sum_compiled(x)        # a decode step's activation: no chunk loop, no views
            return
        work = x if x.is_contiguous() else x.contiguous()
        flat = work.view(-1)
        per = SLOT_BYTES // x.element_size()
        for start in range(0, flat.numel(), per):
            piece = flat[start:start + per]
            if compiled:
                self._sum_compiled(piece)
            else:
                self._sum(self._exchange(piece), piece)
        if work is not x:
            x.copy_(work)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` `[..., n]` side by side in rank order along the last dimension -> `[..., size * n]`."""
        x = x.contiguous()
        n = x.shape[-1]
        out = torch.empty(*x.shape[:-1], self.size * n, dtype=x.dtype)
        if x.numel() == 0:
            return out
        rows_in, rows_out = x.view(-1, n), out.view(-1, self.size * n)
        per = SLOT_BYTES // x.element_size()
        tile_rows, tile_cols = (per // n, n) if n <= per else (1, per)
        for r0 in range(0, rows_in.shape[0], tile_rows):
            for c0 in range(0, n, tile_cols):
                tile = rows_in[r0:r0 + tile_rows, c0:c0 + tile_cols]
                rows, cols = tile.shape
                for j, part in enumerate(self._exchange(tile)):
                    rows_out[r0:r0 + rows, j * n + c0:j * n + c0 + cols].copy_(part.view(rows, cols))
        return out

    def broadcast(self, x: torch.Tensor, src: int, timeout_s: float) -> None:
        """Rank `src`'s `x` into every rank's `x` (same shape and dtype on every rank), waiting up to
        `timeout_s` for the others (a plan: rank 0 may be long between two)."""
        if x.is_contiguous() and x.numel() * x.element_size() <= SLOT_BYTES:
            self._take(x.view(-1), src, timeout_s)     # a plan, a layer's routing: no chunk loop
            return
        work = x if x.is_contiguous() else x.contiguous()
        flat = work.view(-1)
        per = SLOT_BYTES // x.element_size()
        for start in range(0, max(flat.numel(), 1), per):
            self._take(flat[start:start + per], src, timeout_s)
        if work is not x:
            x.copy_(work)

    # -- one round --

    def _exchange(self, piece: torch.Tensor, publish: bool = True,
                  timeout_s: Optional[float] = None) -> list[torch.Tensor]:
        """Publish `piece` (at most SLOT_BYTES; `publish` False: only arrive) and return every rank's piece of
        this round, in rank order."""
        buf = self._slots[self._round % 2]
        nbytes = piece.numel() * piece.element_size()
        if self.ops is not None:
            self._publish_wait(piece if piece.is_contiguous() else piece.contiguous(), publish, timeout_s)
        else:
            self._round += 1
            if publish:
                buf[self.rank][:nbytes].view(piece.dtype).view(piece.shape).copy_(piece)
            for peer in range(self.size):
                if peer != self.rank and self._libc.sem_post(self._sems[peer][self.rank]) != 0:
                    raise ShmCollectiveError(f"rank {self.rank}: sem_post failed: {os.strerror(ctypes.get_errno())}")
            for peer in range(self.size):
                if peer != self.rank:
                    self._wait(peer, timeout_s)
        return [slot[:nbytes].view(piece.dtype) for slot in buf]

    def _sum_compiled(self, piece: torch.Tensor) -> None:
        """One compiled round of a contiguous `piece` and the rank-order sum of its slots into it."""
        self._publish_wait(piece)
        self.ops.sum_slots_(piece, self._slot_base[(self._round - 1) % 2], SLOT_BYTES, self.size)

    def _take(self, piece: torch.Tensor, src: int, timeout_s: float) -> None:
        """One round of a broadcast: `src` publishes `piece`, the others arrive and copy its slot into theirs."""
        parts = self._exchange(piece, publish=self.rank == src, timeout_s=timeout_s)
        if self.rank != src:
            piece.copy_(parts[src])

    def _publish_wait(self, piece: torch.Tensor, publish: bool = True, timeout_s: Optional[float] = None) -> None:
        """The compiled round: publish a contiguous `piece` and poll the peers for SPIN_S, then sleep on the
        ones still missing."""
        b = self._round % 2
        self._round += 1
        try:
            missing = self.ops.publish_wait(piece, self._sems_base, LINE, self._slot_base[b], SLOT_BYTES, self.rank,
                                            self.size, SPIN_S, publish)
        except RuntimeError as e:      # a semaphore call failed
            raise ShmCollectiveError(str(e)) from e
        if missing >= 0:
            for peer in range(missing, self.size):
                if peer != self.rank:
                    self._sleep_wait(peer, timeout_s)

    def _sum(self, parts: list[torch.Tensor], out: torch.Tensor) -> None:
        """parts[0] + parts[1] + ... in that order into `out`. A 16-bit add computes in float32 and rounds
        once, so two parts need no scratch; more accumulate in float32 and round once at the end."""
        if len(parts) == 2 or out.dtype not in (torch.bfloat16, torch.float16):
            torch.add(parts[0], parts[1], out=out)
            for part in parts[2:]:
                out.add_(part)
            return
        acc = self._scratch[:out.numel()]
        acc.copy_(parts[0])
        for part in parts[1:]:
            acc.add_(part)
        out.copy_(acc)

    def _wait(self, peer: int, timeout_s: Optional[float] = None) -> None:
        """Take peer's post of this round: poll up to SPIN_S, then sleep on it (`_sleep_wait`)."""
        sem = self._sems[self.rank][peer]
        start = time.perf_counter()
        while time.perf_counter() - start < SPIN_S:
            if self._libc.sem_trywait(sem) == 0:
                return
        self._sleep_wait(peer, timeout_s)

    def _sleep_wait(self, peer: int, timeout_s: Optional[float] = None) -> None:
        """Take peer's post of this round, sleeping in LIVENESS_S slices up to `timeout_s` (default: the
        group's); a peer that exited fails at once."""
        sem = self._sems[self.rank][peer]
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            if self._sleep_on(sem, min(deadline, time.monotonic() + LIVENESS_S)):
                return
            if not _alive(self.peer_pids[peer]):
                raise ShmCollectiveError(f"rank {self.rank}: rank {peer} (pid {self.peer_pids[peer]}) exited "
                                         f"during a shared-memory collective")
            if time.monotonic() >= deadline:
                raise ShmCollectiveError(f"rank {self.rank}: rank {peer} did not reach the shared-memory "
                                         f"collective within {self.timeout_s if timeout_s is None else timeout_s:g} s")

    def _sleep_on(self, sem: ctypes.c_void_p, until: float) -> bool:
        """sem_wait until monotonic time `until`; False when it passed first."""
        if self._clockwait is not None:
            ts = _timespec(until)
            rc = self._clockwait(sem, CLOCK_MONOTONIC, ctypes.byref(ts))
        else:   # sem_timedwait counts in wall-clock time: convert the deadline
            ts = _timespec(time.time() + until - time.monotonic())
            rc = self._libc.sem_timedwait(sem, ctypes.byref(ts))
        if rc == 0:
            return True
        errno = ctypes.get_errno()
        if errno in (0, 4, 110):     # EINTR, ETIMEDOUT: the caller checks the peer and the deadline
            return False
        raise ShmCollectiveError(f"rank {self.rank}: sem wait failed: {os.strerror(errno)}")


def _timespec(t: float) -> _Timespec:
    sec = int(t)
    return _Timespec(sec, int((t - sec) * 1e9))


def _sem_offset(size: int, r: int, j: int) -> int:
    return LINE * (1 + r * size + j)


def _slots_offset(size: int) -> int:
    return mmap.PAGESIZE * -(-_sem_offset(size, size, 0) // mmap.PAGESIZE)


def segment_bytes(size: int) -> int:
    """The segment's size for `size` ranks."""
    return _slots_offset(size) + 2 * size * SLOT_BYTES


def _create(size: int) -> tuple[str, Optional[mmap.mmap]]:
    """Rank 0: a new segment with its semaphores initialised, or ("", None) when that is not possible."""
    remove_stale_segments()
    name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        logger.warning("no shared-memory segment for the tensor-parallel collectives (%s); using gloo", e)
        return "", None
    try:
        os.posix_fallocate(fd, 0, segment_bytes(size))    # now, not as a SIGBUS on first touch
        mm = mmap.mmap(fd, segment_bytes(size))
    except OSError as e:
        os.close(fd)
        _unlink(name)
        logger.warning("cannot size the shared-memory segment %s (%s); using gloo", path, e)
        return "", None
    os.close(fd)
    raw = (ctypes.c_char * segment_bytes(size)).from_buffer(mm)
    base = ctypes.addressof(raw)
    libc = _libc()
    for r in range(size):
        for j in range(size):
            if libc.sem_init(ctypes.c_void_p(base + _sem_offset(size, r, j)), 1, 0) != 0:
                del raw
                mm.close()
                _unlink(name)
                logger.warning("sem_init failed (%s); using gloo", os.strerror(ctypes.get_errno()))
                return "", None
    ctypes.c_uint64.from_buffer(mm, 0).value = MAGIC
    del raw
    return name, mm


def _attach(name: str, size: int, rank: int) -> Optional[mmap.mmap]:
    """A rank > 0: map rank 0's segment, or None (logged) when it cannot."""
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != segment_bytes(size):
                raise OSError(f"{os.fstat(fd).st_size} bytes, expected {segment_bytes(size)}")
            mm = mmap.mmap(fd, segment_bytes(size))
        finally:
            os.close(fd)
    except OSError as e:
        logger.warning("rank %d: cannot map the shared-memory segment %s (%s); using gloo", rank, path, e)
        return None
    if ctypes.c_uint64.from_buffer_copy(mm, 0).value != MAGIC:
        mm.close()
        logger.warning("rank %d: %s is not a kvstrata tensor-parallel segment; using gloo", rank, path)
        return None
    return mm


def _broadcast_name(name: str, group: dist.ProcessGroup) -> str:
    """Rank 0's segment name on every rank (a fixed-size byte tensor: no pickle); "" when it has none."""
    data = torch.zeros(NAME_BYTES, dtype=torch.uint8)
    encoded = name.encode()
    data[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    dist.broadcast(data, 0, group=group)
    text = bytes(data.tolist()).rstrip(b"\0").decode("ascii", errors="replace")
    if text and not (text.startswith(NAME_PREFIX) and text.replace("-", "").isalnum()):
        raise ShmCollectiveError(f"unexpected shared-memory segment name {text!r}")
    return text


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def remove_stale_segments() -> None:
    """Unlink the segments of servers whose rank 0 died between creating its segment and unlinking it."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return
    for name in names:
        pid = name[len(NAME_PREFIX):].partition("-")[0]
        if name.startswith(NAME_PREFIX) and pid.isdigit() and not _alive(int(pid)):
            _unlink(name)


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            state = fh.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")
