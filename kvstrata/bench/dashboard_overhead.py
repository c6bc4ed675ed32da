"""`kvstrata bench dashboard`: decode throughput with a client polling /dashboard/data at 10 Hz, and without.

Launches one server (flags this command does not know are passed to it), then runs the same decode batch —
`--streams` concurrent /generate requests of `--output-len` tokens each after a short prompt — in turns,
`--repeat` times each, alternating "no poller" and "poller" so that slow spells of a shared machine fall
on both. The poller asks for /dashboard/data?since=... at `--poll-hz` like a page would, only faster.
Decode throughput = generated tokens / wall seconds of the batch (prefill is a few tokens per stream).

Wall-clock throughput on a shared machine is noisy, so the scheduler process's own CPU time is reported
too (it runs on this machine: the benchmark launches it): CPU milliseconds per generated token with and
without the poller, and CPU milliseconds per second of an idle server with and without it. Last, what one
sample costs the scheduler, timed in this process on an offline Engine of the same model after the same
kind of requests, with the host tier on: `get_state(full=False)` (the dashboard's) next to `get_state()`
(/server_info's).

    kvstrata bench dashboard --model-path bench --streams 4 --output-len 128 --repeat 5
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import psutil
import requests

from kvstrata.bench.launcher import ServerProcess


def build_parser() -> argparse.ArgumentParser:
    """The command's flags (unknown ones go to the server)."""
    p = argparse.ArgumentParser(prog="kvstrata bench dashboard", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="bench")
    p.add_argument("--streams", type=int, default=4, help="Concurrent requests in the decode batch.")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeat", type=int, default=5, help="Batches per mode (alternating).")
    p.add_argument("--poll-hz", type=float, default=10.0)
    p.add_argument("--idle-s", type=float, default=5.0, help="Idle seconds measured after each batch.")
    p.add_argument("--api-key", default=os.environ.get("KVSTRATA_API_KEY"),
                   help="Bearer token (also given to the server).")
    p.add_argument("--server-start-timeout", type=float, default=600.0)
    return p


def auth(args: argparse.Namespace) -> dict[str, str]:
    """The Authorization header of --api-key (empty without one)."""
    return {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}


class Poller:
    """A thread that GETs /dashboard/data at a fixed rate, as the page does (with `since`)."""

    def __init__(self, url: str, hz: float, headers: dict[str, str]):
        self.url, self.period, self.headers = url, 1.0 / hz, headers
        self.polls = self.rows = self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        since, session = time.time(), requests.Session()     # only samples taken while this poller runs
        session.headers.update(self.headers)
        while not self._stop.wait(self.period):
            try:
                data = session.get(f"{self.url}/dashboard/data?since={since}", timeout=10).json()
                self.rows += len(data["rows"])
                since = data["rows"][-1][0] if data["rows"] else since
            except (requests.RequestException, ValueError, KeyError, IndexError):
                self.errors += 1
            self.polls += 1


def cpu_s(proc: psutil.Process) -> float:
    """CPU seconds of a process's threads so far: Linux's per-thread schedstat (nanoseconds; a batch of a few
    dozen tokens can take less than psutil's 10 ms tick), else psutil's user + system."""
    tasks = Path(f"/proc/{proc.pid}/task")
    try:
        total = 0
        for task in tasks.iterdir():
            with contextlib.suppress(OSError):   # a thread that ended meanwhile
                total += int((task / "schedstat").read_text().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        t = proc.cpu_times()
        return t.user + t.system


def decode_batch(url: str, args: argparse.Namespace, rng: random.Random, sched: psutil.Process) -> tuple[float, float]:
    """(generated tokens per second, scheduler CPU ms per token) of one batch of concurrent requests."""
    body = {"sampling_params": {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}}

    def one(_: int) -> int:
        ids = [rng.randrange(100, 200) for _ in range(args.prompt_len)]
        r = requests.post(url + "/generate", json={**body, "input_ids": ids}, headers=auth(args), timeout=600)
        r.raise_for_status()
        return r.json()["meta_info"]["completion_tokens"]

    start, cpu0 = time.perf_counter(), cpu_s(sched)
    with concurrent.futures.ThreadPoolExecutor(args.streams) as pool:
        tokens = sum(pool.map(one, range(args.streams)))
    return tokens / (time.perf_counter() - start), 1e3 * (cpu_s(sched) - cpu0) / tokens


def idle_cpu(sched: psutil.Process, seconds: float) -> float:
    """Scheduler CPU milliseconds per second over `seconds` of wall clock."""
    cpu0 = cpu_s(sched)
    time.sleep(seconds)
    return 1e3 * (cpu_s(sched) - cpu0) / seconds


def run(args: argparse.Namespace, url: str) -> dict:
    """Alternate the two modes; per mode: tokens/s and scheduler CPU ms/token per batch, idle CPU ms/s."""
    rng = random.Random(0)
    info = requests.get(url + "/server_info", headers=auth(args), timeout=30).json()
    sched = psutil.Process(info["scheduler_pid"])
    decode_batch(url, args, rng, sched)                # warm-up
    out: dict = {k: {"none": [], "poll": []} for k in ("tok_s", "cpu_ms_per_token", "idle_cpu_ms_per_s")}
    polls = rows = errors = 0
    for i in range(args.repeat):
        for mode in ("none", "poll") if i % 2 == 0 else ("poll", "none"):    # neither mode always goes first
            with contextlib.ExitStack() as stack:
                poller = stack.enter_context(Poller(url, args.poll_hz, auth(args))) if mode == "poll" else None
                rate, cpu = decode_batch(url, args, rng, sched)
                out["idle_cpu_ms_per_s"][mode].append(idle_cpu(sched, args.idle_s))
            out["tok_s"][mode].append(rate)
            out["cpu_ms_per_token"][mode].append(cpu)
            if poller is not None:
                polls, rows, errors = polls + poller.polls, rows + poller.rows, errors + poller.errors
    return {**out, "polls": polls, "rows": rows, "poll_errors": errors}


def sample_cost_ms(args: argparse.Namespace, n: int = 50) -> dict[str, float]:
    """Best-of-n milliseconds of the scheduler's get_state, light and full, on an offline Engine."""
    import kvstrata

    engine = kvstrata.Engine(model_path=args.model_path, enable_hierarchical_cache=True)   # L2's stats included
    try:
        rng = random.Random(0)
        for _ in range(2 * args.streams):
            engine.generate(input_ids=[rng.randrange(100, 200) for _ in range(args.prompt_len)],
                            sampling_params={"max_new_tokens": 8})
        out = {}
        for name, full in (("light", False), ("full", True)):
            times = []
            for _ in range(n):
                start = time.perf_counter()
                engine.scheduler.get_state(full)
                times.append(time.perf_counter() - start)
            out[name] = 1e3 * min(times)
        return out
    finally:
        engine.shutdown()


def report(result: dict, args: argparse.Namespace) -> str:
    """Medians (and ranges) of each measure in each mode, and the change."""
    lines = [f"decode batch: {args.streams} streams x {args.output_len} tokens, {args.repeat} batches per mode; "
             f"poller at {args.poll_hz:g} Hz made {result['polls']} requests, got {result['rows']} new samples, "
             f"{result['poll_errors']} errors",
             f"{'':34}{'no poller':>22}{'poller':>22}  change"]
    for key, label in (("tok_s", "decode tokens/s"), ("cpu_ms_per_token", "scheduler CPU ms per token"),
                       ("idle_cpu_ms_per_s", f"idle scheduler CPU ms/s ({args.idle_s:g} s)")):
        none, poll = (statistics.median(result[key][m]) for m in ("none", "poll"))
        cells = [f"{statistics.median(v):8.2f} ({min(v):.2f}..{max(v):.2f})" for v in result[key].values()]
        change = f"{100 * (poll - none) / none:+.1f}%" if none else "n/a"
        lines.append(f"{label:34}{cells[0]:>22}{cells[1]:>22}  {change}")
    cost = result.get("sample_ms")
    if cost:
        lines.append(f"one sample on the scheduler: get_state(full=False) {cost['light']:.3f} ms "
                     f"(/server_info's full get_state on the idle scheduler: {cost['full']:.3f} ms); at one "
                     f"sample per second that is {cost['light'] / 10:.4f}% of the scheduler's time")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point."""
    args, server_flags = build_parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    log = os.path.join(tempfile.gettempdir(), f"kvstrata-bench-dashboard-{os.getpid()}.log")
    flags = ["--model-path", args.model_path, *server_flags] + (["--api-key", args.api_key] if args.api_key else [])
    with ServerProcess(flags, log).start(args.server_start_timeout) \
            as server:
        result = run(args, server.url)
    result["sample_ms"] = sample_cost_ms(args)
    print(report(result, args))
    return 0
