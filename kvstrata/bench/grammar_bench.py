"""`kvstrata bench grammar`: what structured output costs, measured through a launched server.

1. Decode throughput at S concurrent streams (default 8), unconstrained vs constrained by a JSON schema
   whose shortest valid output is far longer than the requests (an array with minItems), so that both
   decode exactly `--max-new-tokens` tokens (ignore_eos). Rounds alternate between the two modes and the
   median is reported, because a shared machine is noisy. Next to wall-clock tokens/s it reports tokens
   per CPU-second of the server's processes, which other load on the machine disturbs much less.
2. Time to first token of one request with a never-seen schema (compiled while it waits) and with the
   same schema again (compiled grammar cached), next to an unconstrained request.
The first constrained request of a server also builds the grammar backend (tokenizer tables); it is
done in a warm-up and reported on its own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import psutil
import requests

from kvstrata.bench.launcher import ServerProcess

PROMPT = "Write the inventory of the warehouse as JSON."


def long_schema(tag: str = "") -> dict:
    """A JSON schema no short output satisfies: at least 64 items of {id, label, tags}."""
    item = {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0},
        "label": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
        "required": ["id", "label", "tags"]}
    return {"type": "object", "properties": {f"warehouse{tag}": {"type": "string", "maxLength": 32},
                                             "items": {"type": "array", "items": item, "minItems": 64}},
            "required": [f"warehouse{tag}", "items"]}


@dataclass
class StreamTiming:
    """One streamed request: when its first and last tokens came, and how many it got."""

    start: float
    first: Optional[float] = None
    last: Optional[float] = None
    tokens: int = 0
    finish: Optional[dict] = None


def stream_once(url: str, sampling: dict, timeout_s: float = 600.0) -> StreamTiming:
    """POST a streaming /generate and time its events; raises on any error."""
    t = StreamTiming(time.perf_counter())
    with requests.post(url + "/generate", json={"text": PROMPT, "sampling_params": sampling, "stream": True},
                       stream=True, timeout=timeout_s) as r:
        r.raise_for_status()
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                break
            event = json.loads(payload)
            if "error" in event:
                raise RuntimeError(f"error event: {event['error']}")
            now = time.perf_counter()
            if event["output_ids"] and t.first is None:
                t.first = now
            t.last, t.tokens = now, len(event["output_ids"])
            t.finish = event["meta_info"]["finish_reason"]
    if t.first is None:
        raise RuntimeError("a stream ended without output")
    return t


def server_cpu_seconds(pid: int) -> Callable[[], float]:
    """A function returning the CPU seconds used so far by the server process `pid` and its children."""
    def total() -> float:
        root = psutil.Process(pid)
        seconds = 0.0
        for proc in [root, *root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            seconds += times.user + times.system
        return seconds

    return total


def decode_round(url: str, streams: int, sampling: dict, cpu: Callable[[], float]) -> dict:
    """S concurrent streams: decode tokens/s while all of them ran, e2e tokens/s, tokens per server CPU-second."""
    cpu_start = cpu()
    with ThreadPoolExecutor(streams) as pool:
        timings = list(pool.map(lambda _: stream_once(url, sampling), range(streams)))
    cpu_used = cpu() - cpu_start
    start = min(t.start for t in timings)
    first, end = max(t.first for t in timings), max(t.last for t in timings)
    tokens = sum(t.tokens for t in timings)
    return {"decode_tok_s": (tokens - len(timings)) / (end - first), "e2e_tok_s": tokens / (end - start),
            "tok_per_cpu_s": tokens / cpu_used, "tokens": [t.tokens for t in timings]}


def measure_throughput(url: str, args: argparse.Namespace, cpu: Callable[[], float]) -> dict:
    """Alternating rounds of unconstrained and constrained decoding; medians and their ratio."""
    base = {"temperature": 0, "max_new_tokens": args.max_new_tokens, "ignore_eos": True}
    modes = {"unconstrained": base, "json_schema": {**base, "json_schema": json.dumps(long_schema())}}
    rounds: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode, sampling in modes.items():
            rounds[mode].append(decode_round(url, args.streams, sampling, cpu))
    out = {}
    for mode, results in rounds.items():
        if any(t != args.max_new_tokens for r in results for t in r["tokens"]):
            raise RuntimeError(f"{mode}: a stream did not decode {args.max_new_tokens} tokens: {results}")
        out[mode] = {key: statistics.median(r[key] for r in results)
                     for key in ("decode_tok_s", "e2e_tok_s", "tok_per_cpu_s")}
        out[mode]["rounds_decode_tok_s"] = [round(r["decode_tok_s"], 1) for r in results]
    for key in ("decode_tok_s", "tok_per_cpu_s"):
        out[f"ratio_{key}"] = out["json_schema"][key] / out["unconstrained"][key]
    return out


def measure_ttft(url: str, args: argparse.Namespace) -> dict:
    """TTFT of a never-seen schema, the same schema cached, and no schema (medians of --ttft-repeats)."""
    new, cached, plain = [], [], []
    for _ in range(args.ttft_repeats):
        schema = json.dumps(long_schema(uuid.uuid4().hex[:8]))   # new text: a new compile
        sampling = {"temperature": 0, "max_new_tokens": 1, "json_schema": schema}
        for times in (new, cached):
            t = stream_once(url, sampling)
            times.append(t.first - t.start)
        t = stream_once(url, {"temperature": 0, "max_new_tokens": 1})
        plain.append(t.first - t.start)
    return {"new_schema_ttft_s": statistics.median(new), "cached_schema_ttft_s": statistics.median(cached),
            "unconstrained_ttft_s": statistics.median(plain)}


def warm_up(url: str, streams: int, cpu: Callable[[], float]) -> float:
    """One unconstrained round, then the server's first constrained request (builds the grammar backend)."""
    decode_round(url, streams, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}, cpu)
    t = stream_once(url, {"temperature": 0, "max_new_tokens": 1, "regex": "[a-z]+"})
    return t.first - t.start


def main(argv: Optional[list[str]] = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(prog="kvstrata bench grammar", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="bench")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the server (1: steadiest on a small shared CPU)")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ttft-repeats", type=int, default=3)
    p.add_argument("--server-args", default="", help="extra server flags, one string")
    p.add_argument("--output", help="also write the result as JSON to this file")
    args = p.parse_args(argv)
    server_args = ["--model-path", args.model_path, "--dtype", args.dtype, "--num-threads", str(args.threads),
                   "--max-total-tokens", str(args.streams * (args.max_new_tokens + 64) + 1024),
                   "--random-seed", "0", "--log-level", "warning", *args.server_args.split()]
    log = tempfile.NamedTemporaryFile(prefix="kvstrata-grammar-bench-", suffix=".log", delete=False).name
    with ServerProcess(server_args, log) as server:
        cpu = server_cpu_seconds(server.proc.pid)
        first_constrained_ttft = warm_up(server.url, args.streams, cpu)
        throughput = measure_throughput(server.url, args, cpu)
        ttft = measure_ttft(server.url, args)
    result = {"config": vars(args), "first_constrained_request_ttft_s": first_constrained_ttft,
              **throughput, **ttft}
    print(json.dumps(result, indent=2))
    u, c = throughput["unconstrained"], throughput["json_schema"]
    print(f"\n{args.streams} streams x {args.max_new_tokens} tokens ({args.model_path}, {args.dtype}): decode "
          f"{u['decode_tok_s']:.1f} tok/s unconstrained, {c['decode_tok_s']:.1f} tok/s with a JSON schema "
          f"({throughput['ratio_decode_tok_s']:.0%}); per server CPU-second {u['tok_per_cpu_s']:.1f} vs "
          f"{c['tok_per_cpu_s']:.1f} tokens ({throughput['ratio_tok_per_cpu_s']:.0%})")
    print(f"TTFT: new schema {ttft['new_schema_ttft_s'] * 1e3:.0f} ms, cached schema "
          f"{ttft['cached_schema_ttft_s'] * 1e3:.0f} ms, unconstrained {ttft['unconstrained_ttft_s'] * 1e3:.0f} ms; "
          f"first constrained request after start {first_constrained_ttft * 1e3:.0f} ms")
    if args.output:
        with open(args.output, "w") as fh:
            json.dump(result, fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
