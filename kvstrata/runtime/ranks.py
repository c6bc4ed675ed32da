"""The tensor-parallel ranks: one process each; rank 0 decides, the others follow its plans.

    rank 0 (the scheduler process, or the Engine's thread)        rank k > 0 (a child process of rank 0)
    RankGroup.start: spawn ranks 1..n-1 of this node, join  --->  run_rank: die with rank 0, bind cores,
    the group (TCP store at --dist-init-addr)                       join the group, load its shard
    ModelRunner.forward: send_plan(FORWARD), run the shard  --->  ModelRunner.follow: receive_plan, run it
    idle: send_plan(IDLE) + a round trip about once a second --->  apply its copies, answer the round trip
    PD handoff: send_plan(HANDOFF) + a call (rank_call.py)  --->  its RankHandoff answers (its KV shard)
    the cache's agreements (RankLink): send_plan(AGREE)     --->  apply its copies and ops (rank_cache.py),
      + an all-reduce (min) of the answers                        answer (L3 groups verified, snapshot done)
    close: send_plan(STOP), join the processes              --->  finish its L3 writes, exit 0

Faults: a rank that dies closes its sockets, so the next collective fails at once on every other rank
(RankFailure); one that hangs makes its peers' collectives time out after --dist-timeout. Rank 0 also
checks its children before every plan it sends. RankFailure ends rank 0's loop (the scheduler process
exits non-zero, the HTTP server turns /health 503 and exits), and ranks > 0 die with rank 0.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from kvstrata.args import ServerArgs
from kvstrata.cache.cache_controller import BACKUP, LOAD_BACK
from kvstrata.cache.storage_io import PREFETCH, STORAGE_BACKUP
from kvstrata.model.parallel import RankFailure, TensorParallel
from kvstrata.net import free_port
from kvstrata.platform import env
from kvstrata.runtime.forward_plan import (
    EMPTY_PLAN,
    Copy,
    CopyKind,
    ForwardPlan,
    PageCopy,
    PlanKind,
    PlanLedger,
    ShardOp,
    gather_ledgers,
    send_plan,
)
from kvstrata.runtime.handoff import RankHandoffFactory
from kvstrata.runtime.rank_call import answer_safely, gather_answers, send_request

logger = logging.getLogger(__name__)

CPU_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"   # SGLang's CPU setting: one core list per rank, '|'-separated
DEFAULT_TIMEOUT_S = 60
IDLE_PLAN_S = 1.0
STOP_JOIN_S = 10.0
RANK_FAILED_EXIT_CODE = 4
NO_PAGES = torch.empty(0, dtype=torch.long)
COPY_KINDS = {BACKUP: CopyKind.BACKUP, LOAD_BACK: CopyKind.LOAD_BACK}
STORAGE_KINDS = {STORAGE_BACKUP: CopyKind.STORAGE_BACKUP, PREFETCH: CopyKind.STORAGE_PREFETCH}
CARRY_COPIES = (PlanKind.FORWARD, PlanKind.IDLE, PlanKind.AGREE, PlanKind.STOP)   # the kinds that apply copies


def cpu_sets(local_ranks: int, spec: Optional[str] = None, available: Optional[list[int]] = None) -> list[list[int]]:
    """The cores of each local rank: from `spec` (SGLang's '0-3|4-7' format; default $SGLANG_CPU_OMP_THREADS_BIND),
    else this process's allowed cores split evenly in order (the first ranks get one more when uneven)."""
    spec = env(CPU_BIND_ENV) if spec is None else spec
    if spec:
        sets = [_cpu_list(part) for part in spec.split("|")]
        if len(sets) != local_ranks:
            raise ValueError(f"${CPU_BIND_ENV}={spec!r} lists {len(sets)} core sets for {local_ranks} rank(s)")
        return sets
    cores = sorted(available if available is not None else os.sched_getaffinity(0))
    if len(cores) < local_ranks:      # fewer cores than ranks: they share them
        return [cores for _ in range(local_ranks)]
    per, extra = divmod(len(cores), local_ranks)
    sets, start = [], 0
    for r in range(local_ranks):
        n = per + (r < extra)
        sets.append(cores[start:start + n])
        start += n
    return sets


def _cpu_list(text: str) -> list[int]:
    cores: list[int] = []
    try:
        for item in text.split(","):
            lo, _, hi = item.strip().partition("-")
            cores.extend(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"${CPU_BIND_ENV}: {text!r} is not a core list such as '0-3,8'") from None
    if not cores:
        raise ValueError(f"${CPU_BIND_ENV}: empty core list")
    return cores


def bind_rank(args: ServerArgs, rank: int) -> None:
    """Pin this process (thread) to its rank's cores and size torch's thread pool (CPU), or pick its GPU (CUDA)."""
    local = rank % args.local_ranks()
    if args.device == "cuda":
        torch.cuda.set_device(args.base_gpu_id + local)
        return
    cores = cpu_sets(args.local_ranks())[local]
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(args.num_threads or len(cores))
    logger.info("rank %d: cores %s, %d threads", rank, _ranges(cores), torch.get_num_threads())


def _ranges(cores: list[int]) -> str:
    return ",".join(str(c) for c in cores) if len(cores) < 4 else f"{cores[0]}-{cores[-1]} ({len(cores)})"


# On CUDA the model's collectives run on CUDA tensors over NCCL, while the plans, the cache's agreements and
# the start-up checks are CPU tensors, which NCCL cannot carry: torch.distributed routes each tensor by its
# device to its own backend.
CUDA_BACKEND = "cpu:gloo,cuda:nccl"


def join_group(args: ServerArgs, rank: int, init_addr: str) -> TensorParallel:
    """Join the tensor-parallel group as `rank` (gloo on CPU; on CUDA, NCCL for CUDA tensors and gloo for
    CPU ones; the model's collectives through shared memory when `uses_shm_collectives`)."""
    backend = CUDA_BACKEND if args.device == "cuda" else "gloo"
    return TensorParallel.init(rank, args.tp_size, init_addr, backend, args.dist_timeout or DEFAULT_TIMEOUT_S,
                               args.enable_deterministic_inference, expert_parallel=args.ep_size > 1,
                               shm=uses_shm_collectives(args), compiled=not args.disable_cpu_kernels,
                               expert_location=args.init_expert_location,
                               redundant_experts=args.ep_num_redundant_experts)


def uses_shm_collectives(args: ServerArgs) -> bool:
    """Whether the ranks' all-reduce and all-gather go through shared memory: CPU ranks all on one machine,
    unless --disable-custom-all-reduce."""
    return args.device == "cpu" and args.nnodes == 1 and args.tp_size > 1 and not args.disable_custom_all_reduce


class RankGroup:
    """Rank 0's side: the group, the processes of this node's other ranks, the plans sent to them; its cache's
    CopyJournal (record_copy) and RankLink (cache/shards.py)."""

    def __init__(self, tp: TensorParallel, procs: dict[int, Any]):
        self.tp = tp
        self.procs = procs       # rank -> multiprocessing.Process (this node's ranks > 0)
        self.last_sent = time.monotonic()
        self.pending_copies: list[Copy] = []   # submitted by rank 0's cache since the last plan
        self.ledger = PlanLedger()
        self.broken = False     # a plan or agreement failed: the cache's later agreements (at close) get 0s

    @classmethod
    def start(cls, args: ServerArgs, rank_side: Optional[RankHandoffFactory] = None) -> RankGroup:
        """Spawn this node's ranks 1..n-1 (each running `rank_side`, the PD handoff's part, if given), bind
        rank 0, and join the group with them."""
        init_addr = args.dist_init_addr or f"127.0.0.1:{free_port()}"
        procs = spawn_ranks(args, range(1, args.local_ranks()), init_addr, rank_side)
        try:
            bind_rank(args, 0)
            return cls(join_group(args, 0, init_addr), procs)
        except BaseException:
            stop_processes(procs)
            raise

    def check_alive(self) -> None:
        """Raise RankFailure if one of this node's ranks has exited."""
        for rank, proc in self.procs.items():
            if not proc.is_alive():
                raise RankFailure(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")

    def record_copy(self, kind: str, device_pages: torch.Tensor, host_pages: torch.Tensor) -> None:
        """The cache's CopyJournal (on the scheduler thread): the copy goes out with the next plan."""
        self.pending_copies.append(PageCopy(COPY_KINDS[kind], device_pages.cpu(), host_pages.cpu()))

    def storage_op(self, kind: str, op_id: int, keys: list[str], host_pages: list[int]) -> None:
        """RankLink: an L3 backup or prefetch of rank 0's; each rank does it on its own shard (next plan)."""
        self.pending_copies.append(ShardOp(STORAGE_KINDS[kind], op_id, list(keys),
                                           torch.tensor(host_pages, dtype=torch.long)))

    def agree_prefetches(self, done: list[tuple[int, int]]) -> list[int]:
        """RankLink: per finished prefetch, the leading groups every rank read and verified (min over ranks)."""
        asks = [ShardOp(CopyKind.PREFETCH_DONE, op_id, [], NO_PAGES) for op_id, _ in done]
        return self._agree(asks, [groups for _, groups in done])

    def snapshot_saved(self, keys: list[str], host_pages: list[int]) -> bool:
        """RankLink: every rank saves its L2 snapshot share of these pages; whether all did."""
        return self._agree([ShardOp(CopyKind.SNAPSHOT_SAVE, -1, keys, torch.tensor(host_pages, dtype=torch.long))],
                           [1]) == [1]

    def snapshot_restored(self, keys: list[str], host_pages: list[int]) -> bool:
        """RankLink: every rank restores its share of the pages rank 0 restored; whether all did."""
        return self._agree([ShardOp(CopyKind.SNAPSHOT_LOAD, -1, keys, torch.tensor(host_pages, dtype=torch.long))],
                           [1]) == [1]

    def _agree(self, asks: list[ShardOp], answers: list[int]) -> list[int]:
        """Send `asks` after the pending copies in an AGREE plan; per ask, the minimum over the ranks of its
        answer (rank 0's: `answers`). A group that already failed agrees on nothing (0s): rank 0 is stopping,
        and its cache closes without asking the ranks again."""
        if self.broken or self.tp.failed:
            return [0] * len(answers)
        self.pending_copies.extend(asks)
        self.send(PlanKind.AGREE)
        try:
            return self.tp.all_min(answers)
        except RankFailure:
            self.broken = True
            raise

    def send(self, kind: PlanKind, plan: ForwardPlan = EMPTY_PLAN) -> None:
        """Broadcast the next plan, with the copies submitted since the last one, to the ranks (after checking
        they are alive)."""
        if self.pending_copies and kind in CARRY_COPIES:
            plan = dataclasses.replace(plan, copies=self.pending_copies)
            self.pending_copies = []
        try:
            self.check_alive()
            send_plan(self.tp, kind, plan, self.ledger)
        except RankFailure:
            self.broken = True
            raise
        self.last_sent = time.monotonic()

    def call(self, request: bytes, local: Callable[[bytes], bytes]) -> list[bytes]:
        """A PD handoff's call: every rank's answer to `request` in rank order, rank 0's from `local` (run while
        the others answer theirs)."""
        self.send(PlanKind.HANDOFF)
        send_request(self.tp, request)
        return gather_answers(self.tp, answer_safely(local, request, self.tp.rank))

    def report(self) -> tuple[list[dict], list[dict]]:
        """Every rank's ledger (plans, copies, pages, digest), in rank order: equal when no rank diverged; and
        the cache share of each rank > 0 (rank_cache.STATE_KEYS)."""
        from kvstrata.runtime.rank_cache import STATE_KEYS

        if self.pending_copies:     # what the cache submitted reaches the ranks first (REPORT carries nothing)
            self.send(PlanKind.IDLE)
            self.tp.all_min([1])
        self.send(PlanKind.REPORT)
        keys = ("plans", "copies", "pages", "digest")
        rows = gather_ledgers(self.tp, self.ledger, [0] * len(STATE_KEYS))
        return ([dict(zip(keys, row)) for row in rows],
                [dict(zip(STATE_KEYS, row[len(keys):])) for row in rows[1:]])

    def beat(self) -> None:
        """While idle, about once a second: an IDLE plan and a round trip (an all-reduce), so that a rank that
        died or hangs is noticed (after --dist-timeout at most) even when no request comes."""
        if time.monotonic() - self.last_sent >= IDLE_PLAN_S:
            self.send(PlanKind.IDLE)
            self.tp.all_min([1])

    def close(self) -> None:
        """Stop the ranks: a STOP plan and a join if the group still works; else (a collective failed, and a
        plan could wait on a hung rank) terminate them at once."""
        if not self.tp.failed:
            try:
                self.send(PlanKind.STOP)
            except RankFailure as e:
                logger.warning("stopping the ranks without a STOP plan: %s", e)
        stop_processes(self.procs, join_s=0.0 if self.tp.failed else STOP_JOIN_S)
        if not self.tp.failed:
            self.tp.close()


def spawn_ranks(args: ServerArgs, ranks: Any, init_addr: str,
                rank_side: Optional[RankHandoffFactory] = None) -> dict[int, Any]:
    """Start a process for each of `ranks` (run_rank), children of this process, which they die with."""
    ctx = multiprocessing.get_context("spawn")
    procs = {}
    for rank in ranks:
        proc = ctx.Process(target=run_rank, args=(args, rank, init_addr, os.getpid(), rank_side),
                           name=f"kvstrata-rank-{rank}", daemon=True)
        proc.start()
        procs[rank] = proc
    return procs


def stop_processes(procs: dict[int, Any], join_s: float = STOP_JOIN_S) -> None:
    """Join each rank process; terminate, then kill, one that does not exit within `join_s`."""
    deadline = time.monotonic() + join_s
    for proc in procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs.values():
        if proc.is_alive():
            proc.terminate()
            proc.join(2.0)
        if proc.is_alive():
            proc.kill()
            proc.join(2.0)


def run_rank(args: ServerArgs, rank: int, init_addr: str, parent_pid: int,
             rank_side: Optional[RankHandoffFactory] = None) -> None:
    """Entry point of a rank > 0: die with its parent, bind, join, load the shard, start its part of the PD
    handoff (`rank_side`), follow rank 0's plans."""
    _die_with_parent(parent_pid)
    logging.basicConfig(level=args.log_level.upper(),
                        format=f"[%(asctime)s rank {rank}] %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)     # rank 0 decides when the ranks stop
    code = 0
    try:
        from kvstrata.runtime.model_runner import ModelRunner

        bind_rank(args, rank)
        tp = join_group(args, rank, init_addr)
        runner = ModelRunner(args, tp)
        runner.follow(rank_side(args, runner.pool, rank) if rank_side is not None else None)
        tp.close()
    except RankFailure as e:
        logger.error("%s; rank %d stops", e, rank)
        code = RANK_FAILED_EXIT_CODE
    except Exception:
        logger.exception("rank %d failed", rank)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)    # no interpreter teardown (seconds with torch loaded); nothing else runs here


def run_node(args: ServerArgs) -> int:
    """A node other than 0 (--node-rank > 0): run its ranks until they exit; non-zero if any failed."""
    first = args.node_rank * args.local_ranks()
    procs = spawn_ranks(args, range(first, first + args.local_ranks()), args.dist_init_addr or "")
    codes = []
    for rank, proc in procs.items():
        proc.join()
        codes.append(proc.exitcode)
        if proc.exitcode:
            logger.error("rank %d exited with code %s", rank, proc.exitcode)
    stop_processes(procs)
    return next((c for c in codes if c), 0)


def _die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when its parent (rank 0, or a node's launcher) dies."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))   # PR_SET_PDEATHSIG
        except OSError:
            pass
    if os.getppid() != parent_pid:
        os._exit(1)
