"""`kvstrata bench pd`: prefill/decode disaggregation against one co-located server, same model and load.

Workload: `--decoders` clients each stream `--decode-requests` requests back to back (a short prompt and
`--decode-tokens` output tokens, ignore_eos), while one client sends `--long-prompts` long prompts
(`--long-len` fresh random tokens each, a few output tokens) every `--long-interval` seconds. In the
co-located server every long prefill lands in the batches of the decoding requests; with PD it runs on the
prefill server and the decode server only receives its KV.

Setups: PD = a prefill server on core A and a decode server on core B (taskset, one torch thread each),
behind `kvstrata router --pd-disaggregation`; co-located = one server on both cores (two threads).
Reported: TTFT (mean, P90) of the decoding and of the long requests, inter-token latency (P50, P99) of the
decoding requests, failures, and the KV transfer throughput (decode's transfer bytes / seconds over
loopback TCP) next to a plain in-memory copy of the same bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import random
import statistics
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Optional

import aiohttp
import requests
import torch

from kvstrata.bench.client import generate_payload
from kvstrata.bench.launcher import ServerProcess, free_port
from kvstrata.bench.report import markdown_table
from kvstrata.bench.workload import TokenSpace, synthetic_prompts

MOONCAKE_ENV = {"MC_LEGACY_RPC_PORT_BINDING": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1"}


@dataclass
class Stream:
    """Event times of one streamed request."""

    kind: str                                 # "decode" | "long"
    ttft: Optional[float] = None
    gaps: list[float] = field(default_factory=list)   # per-token inter-token latencies
    error: Optional[str] = None


async def timed_stream(session: aiohttp.ClientSession, url: str, ids: list[int], max_new: int, kind: str) -> Stream:
    """Stream one /generate; per-token gaps are an event's gap spread over the tokens it carries."""
    out = Stream(kind)
    start = last = time.perf_counter()
    seen = 0
    try:
        async with session.post(url + "/generate", json=generate_payload(ids, max_new)) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return out
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:") or line.endswith("[DONE]"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    out.error = str(event["error"])
                    return out
                now, n = time.perf_counter(), len(event.get("output_ids") or [])
                if n > seen:
                    if out.ttft is None:
                        out.ttft = now - start
                    else:
                        out.gaps += [(now - last) / (n - seen)] * (n - seen)
                    seen, last = n, now
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


async def run_workload(url: str, args: argparse.Namespace, space: TokenSpace) -> list[Stream]:
    """The decoding clients and the long-prompt client, all at once."""
    rng = random.Random(args.seed)
    short = synthetic_prompts(args.decoders * args.decode_requests, args.short_len, space, rng)
    longs = synthetic_prompts(args.long_prompts, args.long_len, space, rng)
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def decoder(c: int) -> list[Stream]:
            mine = short[c * args.decode_requests:(c + 1) * args.decode_requests]
            return [await timed_stream(session, url, ids, args.decode_tokens, "decode") for ids in mine]

        async def long_client() -> list[Stream]:
            out = []
            for ids in longs:
                await asyncio.sleep(args.long_interval)
                out.append(asyncio.ensure_future(timed_stream(session, url, ids, args.long_tokens, "long")))
            return list(await asyncio.gather(*out))

        results = await asyncio.gather(long_client(), *(decoder(c) for c in range(args.decoders)))
    return [s for group in results for s in group]


def summarize(streams: list[Stream]) -> dict:
    """TTFT and inter-token latency statistics per request kind."""
    out: dict = {"failed": sum(s.error is not None for s in streams),
                 "errors": [s.error for s in streams if s.error][:3]}
    for kind in ("decode", "long"):
        ok = [s for s in streams if s.kind == kind and s.error is None]
        ttfts = sorted(s.ttft for s in ok if s.ttft is not None)
        gaps = sorted(g for s in ok for g in s.gaps)
        out[kind] = {"requests": len(ok), "mean_ttft": statistics.fmean(ttfts) if ttfts else float("nan"),
                     "p90_ttft": pct(ttfts, 0.9), "p50_itl": pct(gaps, 0.5), "p99_itl": pct(gaps, 0.99)}
    return out


def pct(xs: list[float], q: float) -> float:
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def memcpy_gbps(nbytes: int, min_seconds: float = 0.1) -> float:
    """GB/s of a plain memmove of `nbytes` (one thread, like one transfer), repeated for at least `min_seconds`."""
    src = torch.empty(max(nbytes, 1), dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)    # first touch of dst's pages is not a copy's cost
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_seconds:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes)
        count += 1
    return nbytes * count / elapsed / 1e9


def pinned(proc: ServerProcess, cores: str) -> ServerProcess:
    """Run `proc` under taskset on `cores` (its scheduler process inherits the mask)."""
    proc.cmd = ["taskset", "-c", cores, *proc.cmd]
    return proc


def server_flags(args: argparse.Namespace, threads: int) -> list[str]:
    """Flags shared by every server of the benchmark."""
    return ["--model-path", args.model_path, "--max-total-tokens", str(args.max_total_tokens), "--random-seed",
            "0", "--log-level", "warning", "--num-threads", str(threads), *args.server_args.split()]


def run_colocated(args: argparse.Namespace, space: TokenSpace, logdir: str) -> dict:
    """One server on both cores."""
    threads = args.colocated_threads
    with pinned(ServerProcess(server_flags(args, threads), f"{logdir}/colocated.log"), args.cores) as server:
        warm_up(server.url, space)
        return summarize(asyncio.run(run_workload(server.url, args, space)))


def run_pd(args: argparse.Namespace, space: TokenSpace, logdir: str) -> dict:
    """Prefill on the first core, decode on the second, the PD router in front."""
    first, second = args.cores.split(",")[:2]
    port = free_port()
    pd = ["--disaggregation-mode", "--disaggregation-transfer-backend", "mooncake"]
    with ExitStack() as stack:
        prefill = pinned(ServerProcess([*server_flags(args, 1), pd[0], "prefill", *pd[1:],
                                        "--disaggregation-bootstrap-port", str(port)], f"{logdir}/prefill.log",
                                       env=MOONCAKE_ENV), first)
        decode = pinned(ServerProcess([*server_flags(args, 1), pd[0], "decode", *pd[1:]], f"{logdir}/decode.log",
                                      env=MOONCAKE_ENV), second)
        stack.enter_context(prefill)
        stack.enter_context(decode)
        router = stack.enter_context(ServerProcess(
            ["--pd-disaggregation", "--prefill", prefill.url, str(port), "--decode", decode.url, "--log-level",
             "warning"], f"{logdir}/router.log", module="kvstrata.router"))
        wait_router(router.url)
        warm_up(router.url, space)
        before = _disagg(decode.url)
        result = summarize(asyncio.run(run_workload(router.url, args, space)))
        after = _disagg(decode.url)
    nbytes = after["transfer_bytes_total"] - before["transfer_bytes_total"]
    seconds = after["transfer_seconds_total"] - before["transfer_seconds_total"]
    count = max(1, after["transfers_ok"] - before["transfers_ok"])
    result["transfer"] = {"transfers": count, "bytes": nbytes, "gbps": nbytes / seconds / 1e9 if seconds else 0.0,
                          "memcpy_gbps": memcpy_gbps(max(nbytes // count, 1))}
    return result


def _disagg(url: str) -> dict:
    return requests.get(url + "/server_info", timeout=30).json()["internal_states"][0]["disaggregation"]


def wait_router(url: str, timeout_s: float = 60.0) -> None:
    """Until the router sees both servers healthy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = requests.get(url + "/list_workers", timeout=5).json()["workers"]
        if len(workers) == 2 and all(w["healthy"] for w in workers):
            return
        time.sleep(0.2)
    raise RuntimeError("the router did not see both servers healthy")


def warm_up(url: str, space: TokenSpace) -> None:
    """One request of each shape, so that first-use costs stay out of the numbers."""
    rng = random.Random(-1)
    for n in (16, 512):
        ids = synthetic_prompts(1, n, space, rng)[0]
        requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4}},
                      timeout=300).raise_for_status()


def report(pd: dict, co: dict) -> str:
    """A markdown table of both setups."""
    rows = []
    for name, r in ((f"co-located (2 cores, {co['threads']} threads)", co), ("PD: prefill + decode (1 core each)", pd)):
        d, lg = r["decode"], r["long"]
        rows.append([name, f"{d['mean_ttft']:.3f}", f"{d['p90_ttft']:.3f}", f"{1000 * d['p50_itl']:.1f}",
                     f"{1000 * d['p99_itl']:.1f}", f"{lg['mean_ttft']:.3f}", f"{lg['p90_ttft']:.3f}", str(r["failed"])])
    table = markdown_table(["setup", "decode mean TTFT (s)", "decode P90 TTFT (s)", "ITL P50 (ms)", "ITL P99 (ms)",
                            "long mean TTFT (s)", "long P90 TTFT (s)", "failed"], rows)
    t = pd["transfer"]
    return (f"{table}\n\nKV transfer: {t['transfers']} transfers, {t['bytes'] / 1e6:.1f} MB, {t['gbps']:.2f} GB/s "
            f"over loopback TCP (Mooncake transfer engine); a plain memory copy of the same bytes per request: "
            f"{t['memcpy_gbps']:.2f} GB/s")


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(prog="kvstrata bench pd", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="bench")
    p.add_argument("--cores", default="0,1", help="two CPU ids: prefill's, decode's (co-located gets both)")
    p.add_argument("--colocated-threads", type=int, default=2, help="torch threads of the co-located server")
    p.add_argument("--decoders", type=int, default=4, help="concurrent decoding clients")
    p.add_argument("--decode-requests", type=int, default=3, help="requests per decoding client")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--short-len", type=int, default=32)
    p.add_argument("--long-prompts", type=int, default=4)
    p.add_argument("--long-len", type=int, default=1024)
    p.add_argument("--long-tokens", type=int, default=4)
    p.add_argument("--long-interval", type=float, default=2.0, help="seconds between long prompts")
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="extra flags for every server, one string")
    p.add_argument("--output", help="also write the result as JSON to this file")
    args = p.parse_args(argv)
    from kvstrata.bench.workload import token_space_from_tokenizer
    from kvstrata.model.builtin import resolve_model_path
    from kvstrata.model.tokenizer import load_tokenizer

    space = token_space_from_tokenizer(load_tokenizer(resolve_model_path(args.model_path)))
    logdir = tempfile.mkdtemp(prefix="kvstrata-bench-pd-")
    co = {**run_colocated(args, space, logdir), "threads": args.colocated_threads}
    pd = run_pd(args, space, logdir)
    result = {"config": vars(args), "colocated": co, "pd": pd, "cpu": os.cpu_count(), "logs": logdir}
    print(json.dumps(result, indent=2))
    print("\n" + report(pd, co))
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0
