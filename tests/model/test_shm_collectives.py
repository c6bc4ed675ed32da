"""The shared-memory all-reduce and all-gather (kvstrata/model/shm_collectives.py) between two real processes.

One pair of spawned ranks runs every case (each process imports torch: seconds), reports what it saw to the
test process, and the tests below read the report: sums, gathers and broadcasts in bf16 and float32 against a
plain torch reference and against gloo, chunked and tiled through the segment, through the compiled rounds
(csrc/shm_collectives.cpp) and the plain-torch ones; no segment left in /dev/shm; a rank that
never arrives makes the other raise within the timeout; one that exited fails it at once; a rank that cannot
map the segment makes every rank keep gloo.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import time

import pytest
import torch

from kvstrata.args import ServerArgs
from kvstrata.model import shm_collectives
from kvstrata.net import free_port
from kvstrata.runtime.ranks import uses_shm_collectives
from tests.capabilities import requires_cpu_kernels
from tests.server.conftest import pid_alive

SIZE = 2
GROUP_TIMEOUT_S = 30          # --dist-timeout: generous while the cases run on a loaded machine
TIMEOUT_S = 1.5               # then, for the rank that never arrives
DTYPES = (torch.bfloat16, torch.float32)
# (rows, features): a decode row, batches (an odd size too), and sizes over one slot (chunked / tiled through it)
REDUCE_SHAPES = ((1, 512), (16, 512), (64, 512), (3, 33_333), (700, 1000))
GATHER_SHAPES = ((1, 256), (16, 256), (1500, 256), (2, 300_000))
BROADCASTS = ((7, 0), (1, 1), (300_000, 0))   # (int64 words, source rank): a plan's header, a word, three slots


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, case: int) -> list[torch.Tensor]:
    """Every rank's input of one case (each rank builds all of them: the reference needs them)."""
    return [torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * case + r)).to(dtype)
            for r in range(SIZE)]


def _reference_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc.to(parts[0].dtype)


def _rank(rank: int, addr: str, results) -> None:
    import torch.distributed as dist

    from kvstrata.model.parallel import RankFailure, TensorParallel

    torch.set_num_threads(1)
    tp = TensorParallel.init(rank, SIZE, addr, "gloo", GROUP_TIMEOUT_S, deterministic=False, shm=True)
    report: dict = {"rank": rank, "pid": os.getpid(), "collectives": tp.collectives, "cases": [],
                    "timeout_s": tp.shm.timeout_s if tp.shm is not None else None}
    report["segment"] = tp.shm.name if tp.shm is not None else ""
    report["segment_left"] = bool(report["segment"]) and os.path.exists(f"/dev/shm/{report['segment']}")
    compiled_ops = tp.shm.ops
    report["compiled"] = compiled_ops is not None
    report["non_contiguous"] = []
    for path in ("compiled", "torch"):      # the kernel library's rounds, then the plain-torch ones
        tp.shm.ops = compiled_ops if path == "compiled" else None
        case = 0
        for dtype in DTYPES:
            for shape in REDUCE_SHAPES:
                case += 1
                parts = _inputs(shape, dtype, case)
                got = tp.all_reduce(parts[rank].clone())
                gloo = parts[rank].clone()
                dist.all_reduce(gloo, group=tp.group)
                report["cases"].append((path, "all_reduce", str(dtype), shape,
                                        torch.equal(got, _reference_sum(parts)), torch.equal(got, gloo)))
            for shape in GATHER_SHAPES:
                case += 1
                parts = _inputs(shape, dtype, case)
                got = tp.all_gather(parts[rank])
                report["cases"].append((path, "all_gather", str(dtype), shape, torch.equal(got, torch.cat(parts, -1)),
                                        True))
        for n, src in BROADCASTS:     # plans: int64 words, one slot or several, from either rank
            case += 1
            sent = torch.arange(n, dtype=torch.long) * (case + src)
            got = tp.broadcast(sent.clone() if rank == src else torch.zeros(n, dtype=torch.long), src)
            report["cases"].append((path, "broadcast", str(torch.long), (n, src), torch.equal(got, sent), True))
        # a transposed (non-contiguous) input is summed in place like a contiguous one
        parts = [p.t() for p in _inputs((64, 32), torch.float32, 99)]
        got = parts[rank].clone().t().contiguous().t()
        tp.all_reduce(got)
        report["non_contiguous"].append(torch.equal(got, _reference_sum(parts)))
    tp.shm.ops = compiled_ops

    # a second group whose rank 1 cannot map the segment: both ranks keep torch.distributed
    second = dist.new_group([0, 1], backend="gloo")
    if rank == 1:
        shm_collectives.SHM_DIR = "/nonexistent-shm-dir"
    report["fallback"] = shm_collectives.ShmCollectives.join(rank, SIZE, second, TIMEOUT_S) is None
    shm_collectives.SHM_DIR = "/dev/shm"
    dist.barrier(group=tp.group)

    if rank == 0:    # rank 1 stays alive but never arrives: the timeout
        tp.shm.timeout_s = TIMEOUT_S
        start = time.monotonic()
        try:
            tp.all_reduce(torch.ones(4))
            report["timeout"] = None
        except RankFailure as e:
            report["timeout"] = (time.monotonic() - start, str(e))
        peer = tp.shm.peer_pids[1]
        while pid_alive(peer):        # then rank 1 exits
            time.sleep(0.05)
        tp.shm.timeout_s = 60.0
        start = time.monotonic()
        try:
            tp.all_reduce(torch.ones(4))
            report["exited"] = None
        except RankFailure as e:
            report["exited"] = (time.monotonic() - start, str(e), peer)
    else:
        time.sleep(TIMEOUT_S + 1.0)
    results.put(report)
    results.close()
    results.join_thread()
    os._exit(0)      # no process-group teardown: rank 0's last collective failed on purpose


@pytest.fixture(scope="module")
def reports() -> dict[int, dict]:
    """What each of two spawned ranks saw, by rank."""
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    addr = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_rank, args=(r, addr, results), daemon=True) for r in range(SIZE)]
    for p in procs:
        p.start()
    try:
        got = [results.get(timeout=180) for _ in range(SIZE)]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(5)
    return {r["rank"]: r for r in got}


def test_all_reduce_and_all_gather_match_the_torch_reference_and_gloo_bit_for_bit(reports):
    for rank, report in reports.items():
        assert report["collectives"] == "shm" and report["timeout_s"] == GROUP_TIMEOUT_S, report
        per_path = len(DTYPES) * (len(REDUCE_SHAPES) + len(GATHER_SHAPES)) + len(BROADCASTS)
        assert len(report["cases"]) == 2 * per_path
        wrong = [c for c in report["cases"] if not (c[4] and c[5])]
        assert not wrong, (rank, wrong)
        assert report["non_contiguous"] == [True, True]


@requires_cpu_kernels
def test_the_ranks_poll_and_sum_with_the_compiled_ops_where_the_library_builds(reports):
    assert reports[0]["compiled"] and reports[1]["compiled"]


def test_the_segment_is_unlinked_once_mapped_and_none_is_left_after_the_ranks_exit(reports):
    name = reports[0]["segment"]
    assert name.startswith(shm_collectives.NAME_PREFIX) and name == reports[1]["segment"]
    assert not reports[0]["segment_left"] and not reports[1]["segment_left"]
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"{shm_collectives.NAME_PREFIX}{reports[0]['pid']}-")]


def test_a_rank_that_never_arrives_fails_the_other_within_the_timeout_and_one_that_exited_at_once(reports):
    waited, message = reports[0]["timeout"]
    assert TIMEOUT_S <= waited < TIMEOUT_S + 1.0, waited
    assert "rank 1" in message and "within" in message, message
    waited, message, peer = reports[0]["exited"]
    assert waited < 2.0, waited       # not the 60 s timeout: the peer is gone
    assert f"rank 1 (pid {peer}) exited" in message, message


def test_a_rank_that_cannot_map_the_segment_keeps_every_rank_on_gloo(reports):
    assert reports[0]["fallback"] and reports[1]["fallback"]


def test_a_dead_servers_leftover_segment_is_removed_by_the_next_one():
    dead = subprocess.Popen(["true"])
    dead.wait()
    path = f"/dev/shm/{shm_collectives.NAME_PREFIX}{dead.pid}-0123456789ab"
    ours = f"/dev/shm/{shm_collectives.NAME_PREFIX}{os.getpid()}-0123456789ab"
    for p in (path, ours):
        open(p, "wb").close()
    try:
        shm_collectives.remove_stale_segments()
        assert not os.path.exists(path) and os.path.exists(ours)
    finally:
        for p in (path, ours):
            if os.path.exists(p):
                os.unlink(p)


@pytest.mark.parametrize("flags, expected", [
    ({}, True), ({"disable_custom_all_reduce": True}, False), ({"nnodes": 2, "dist_init_addr": "10.0.0.1:5000"}, False),
    ({"tp_size": 1}, False),
])
def test_shared_memory_is_the_default_for_cpu_ranks_on_one_machine(flags, expected):
    args = ServerArgs(**{"model_path": "tiny", "device": "cpu", "tp_size": 2, **flags})
    assert uses_shm_collectives(args) is expected
    assert uses_shm_collectives(ServerArgs(model_path="tiny", device="cuda", tp_size=2)) is False
    assert not args.no_effect_notes()        # SGLang's --disable-custom-all-reduce picks gloo here
