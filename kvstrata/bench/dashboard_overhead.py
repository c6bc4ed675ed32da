"""`kvstrata bench dashboard`: decode throughput with a client polling /dashboard/data at 10 Hz, and without.

Launches one server (flags this command does not know are passed to it), then runs the same decode batch —
`--streams` concurrent /generate requests of `--output-len` tokens each after a short prompt — in turns,
`--repeat` times each, alternating "no poller" and "poller" so that slow spells of a shared machine fall
on both. The poller asks for /dashboard/data?since=... at `--poll-hz` like a page would, only faster.
Decode throughput = generated tokens / wall seconds of the batch (prefill is a few tokens per stream).
Also reported, as a bound that a busy machine's noise does not hide: the round trip of /server_info on the
idle server (IPC + the scheduler's get_state, which is all a dashboard sample asks of the scheduler).

    kvstrata bench dashboard --model-path bench --streams 4 --output-len 128 --repeat 5
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from typing import Optional

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
        since, session = 0.0, requests.Session()
        session.headers.update(self.headers)
        while not self._stop.wait(self.period):
            try:
                data = session.get(f"{self.url}/dashboard/data?since={since}", timeout=10).json()
                self.rows += len(data["rows"])
                since = data["rows"][-1][0] if data["rows"] else since
            except (requests.RequestException, ValueError, KeyError, IndexError):
                self.errors += 1
            self.polls += 1


def decode_batch(url: str, args: argparse.Namespace, rng: random.Random) -> float:
    """Generated tokens per second of one batch of concurrent requests."""
    body = {"sampling_params": {"temperature": 0, "max_new_tokens": args.output_len, "ignore_eos": True}}

    def one(_: int) -> int:
        ids = [rng.randrange(100, 200) for _ in range(args.prompt_len)]
        r = requests.post(url + "/generate", json={**body, "input_ids": ids}, headers=auth(args), timeout=600)
        r.raise_for_status()
        return r.json()["meta_info"]["completion_tokens"]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.streams) as pool:
        tokens = sum(pool.map(one, range(args.streams)))
    return tokens / (time.perf_counter() - start)


def run(args: argparse.Namespace, url: str) -> dict:
    """Alternate the two modes; returns tokens/s per batch for each, and the poller's counts."""
    rng = random.Random(0)
    decode_batch(url, args, rng)                       # warm-up
    rates: dict[str, list[float]] = {"none": [], "poll": []}
    polls = rows = errors = 0
    for _ in range(args.repeat):
        rates["none"].append(decode_batch(url, args, rng))
        with Poller(url, args.poll_hz, auth(args)) as poller:
            rates["poll"].append(decode_batch(url, args, rng))
        polls, rows, errors = polls + poller.polls, rows + poller.rows, errors + poller.errors
    return {"rates": rates, "polls": polls, "rows": rows, "poll_errors": errors, "sample_s": sample_cost(url, auth(args))}


def sample_cost(url: str, headers: dict[str, str], n: int = 50) -> list[float]:
    """Seconds per /server_info round trip on the idle server, n times."""
    session, out = requests.Session(), []
    session.headers.update(headers)
    for _ in range(n):
        start = time.perf_counter()
        session.get(url + "/server_info", timeout=30).raise_for_status()
        out.append(time.perf_counter() - start)
    return out


def report(result: dict, args: argparse.Namespace) -> str:
    """Median tokens/s of each mode and the change."""
    none, poll = (statistics.median(result["rates"][k]) for k in ("none", "poll"))
    spread = {k: f"{min(v):.1f}..{max(v):.1f}" for k, v in result["rates"].items()}
    return "\n".join([
        f"decode batch: {args.streams} streams x {args.output_len} tokens, {args.repeat} batches per mode",
        f"no poller:           {none:8.1f} tok/s (median; range {spread['none']})",
        f"poller at {args.poll_hz:g} Hz:    {poll:8.1f} tok/s (median; range {spread['poll']})",
        f"change: {100 * (poll - none) / none:+.1f}%; the poller made {result['polls']} requests and got "
        f"{result['rows']} new samples ({result['poll_errors']} errors)",
        f"one sample's round trip on the idle server (/server_info): min {1e3 * min(result['sample_s']):.2f} ms, "
        f"median {1e3 * statistics.median(result['sample_s']):.2f} ms; at one sample per second that bounds the "
        f"scheduler's share at {100 * statistics.median(result['sample_s']):.2f}%"])


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point."""
    args, server_flags = build_parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    log = os.path.join(tempfile.gettempdir(), f"kvstrata-bench-dashboard-{os.getpid()}.log")
    flags = ["--model-path", args.model_path, *server_flags] + (["--api-key", args.api_key] if args.api_key else [])
    with ServerProcess(flags, log).start(args.server_start_timeout) \
            as server:
        result = run(args, server.url)
    print(report(result, args))
    return 0
