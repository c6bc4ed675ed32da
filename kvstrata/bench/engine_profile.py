"""`kvstrata bench engine --profile`: where one prefill step and one decode step spend their time.

Four scenarios on one model, measured in one process with the radix cache on: a fresh N-token prefill; an
M-token extend after an N-token prefix already in the cache (one multi-turn step: a new question after the
history); and a decode step at context N with 1 and with S streams. Each is reported as a breakdown of the
step:

  * scheduler (schedule, process outputs, cache bookkeeping), batch metadata (the runner building the
    forward's inputs), sampler, and the model forward, timed with `perf_counter` (no profiler running;
    each part's fastest of --repeat rounds, the least disturbed estimate on a shared machine);
  * inside the forward, torch.profiler attributes every top-level aten op to the innermost labelled region
    (linear layers, attention kernel, K/V gather, K/V write, attention plan, norms, rope, activations,
    MoE routing, MoE grouping and weighted sum (the expert products count as linear), embedding/residual);
    "Python overhead" is the forward's unprofiled wall time minus all those ops;
  * IPC/result handling: the offline Engine's time per step beyond the scheduler step (queue handoff,
    per-request bookkeeping), from the same workload through `kvstrata.Engine`.

The labels are installed by wrapping functions for the profiled steps only; nothing is left patched.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch.profiler import ProfilerActivity, profile, record_function

from kvstrata.runtime.messages import TokenizedGenerateReq
from kvstrata.runtime.sampling_params import SamplingParams

REGION_PREFIX = "kv::"
# (module, attribute, region): functions labelled while profiling; the innermost label owns an op.
LABELLED = [
    ("kvstrata.model.layers", "Linear.forward", "linear"),
    ("kvstrata.model.layers", "RMSNorm.forward", "norm"),
    ("kvstrata.model.layers", "RMSNorm.add_norm", "norm"),
    ("kvstrata.model.layers", "SiluAndMul.forward", "activation"),
    ("kvstrata.model.moe", "route", "MoE routing"),
    ("kvstrata.model.moe", "FusedExperts.forward", "MoE grouping + sum"),
    ("kvstrata.model.llama", "apply_rotary", "rope"),
    ("kvstrata.model.rope", "RotaryEmbedding.rotation", "rope"),
    ("kvstrata.model.llama", "paged_attention", "attention kernel"),
    ("kvstrata.model.attention", "attention_plan", "attention plan"),
    ("kvstrata.model.attention", "_gather", "K/V gather"),
    ("kvstrata.memory.device_pool", "DeviceKVPool.set_kv", "K/V write"),
]
FORWARD_ROWS = ["linear", "attention kernel", "K/V gather", "K/V write", "attention plan", "norm", "rope",
                "activation", "MoE routing", "MoE grouping + sum", "embedding/residual/other ops", "Python overhead"]


def _resolve(module: str, attr: str) -> tuple[object, str]:
    import importlib

    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


@contextlib.contextmanager
def labelled_regions() -> Iterator[None]:
    """Wrap the LABELLED functions in record_function regions for the duration of the block."""
    saved = []
    for module, attr, region in LABELLED:
        owner, name = _resolve(module, attr)
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, _with_label(original, REGION_PREFIX + region))
    try:
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def _with_label(fn: Callable, label: str) -> Callable:
    def wrapped(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)
    return wrapped


class StepTimer:
    """Accumulates wall time of named scheduler/runner calls by wrapping them on one instance."""

    def __init__(self):
        self.totals: dict[str, float] = defaultdict(float)

    def wrap(self, obj: object, attr: str, name: str) -> None:
        """Time every call of `obj.attr` under `name` (an instance attribute shadows the method)."""
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - t
        setattr(obj, attr, timed)

    def reset(self) -> None:
        """Forget what was timed so far."""
        self.totals.clear()


def _instrument(scheduler) -> StepTimer:
    timer = StepTimer()
    runner = scheduler.runner
    timer.wrap(scheduler, "step", "step")
    timer.wrap(runner, "forward", "runner")
    timer.wrap(runner.model, "forward", "model")
    timer.wrap(runner.sampler, "sample", "sampler")
    return timer


def _request(ids: list[int], max_new_tokens: int) -> TokenizedGenerateReq:
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True})
    return TokenizedGenerateReq(uuid.uuid4().hex, ids, params)


def _is_op(name: str) -> bool:
    """A dispatched operator (aten::mm, kvstrata::paged_attention, ...), not one of our region labels."""
    return "::" in name and not name.startswith(REGION_PREFIX)


def _kernel_breakdown(prof, steps: int) -> dict[str, float]:
    """Seconds per step of top-level aten ops inside the model, by innermost labelled region."""
    out: dict[str, float] = defaultdict(float)
    for ev in prof.events():
        if not _is_op(ev.name):
            continue
        region, parent, inside_model = None, ev.cpu_parent, False
        nested = False
        while parent is not None:
            if _is_op(parent.name):
                nested = True
                break
            if parent.name == REGION_PREFIX + "model":
                inside_model = True
            elif parent.name.startswith(REGION_PREFIX) and region is None:
                region = parent.name[len(REGION_PREFIX):]
            parent = parent.cpu_parent
        if nested or not inside_model:
            continue
        out[region or "embedding/residual/other ops"] += ev.cpu_time_total / 1e6 / steps
    return out


def _profile_steps(scheduler, steps: int, setup: Callable[[], None]) -> dict[str, float]:
    """Kernel seconds per step by region over `steps` profiled steps (after `setup()`)."""
    model = scheduler.runner.model
    original = model.forward

    def labelled_forward(*args, **kwargs):
        with record_function(REGION_PREFIX + "model"):
            return original(*args, **kwargs)
    model.forward = labelled_forward
    try:
        setup()
        with labelled_regions(), profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                scheduler.step()
    finally:
        model.forward = original
    return _kernel_breakdown(prof, steps)


@dataclass
class Scenario:
    """One kind of step to break down."""

    name: str
    start: Callable[[], None]          # queues one round's requests and steps until the measured steps are next
    steps: int                         # scheduler steps measured per round
    engine_prompts: list[list[int]]    # steps of the same shape through kvstrata.Engine, for the IPC row
    engine_new_tokens: int
    verify: Callable[[], None] = lambda: None   # after each measured round: raise if it measured something else


def _decode_ready(scheduler, prompts: list[list[int]], max_new_tokens: int) -> None:
    """Queue the prompts and step until every one is decoding."""
    for ids in prompts:
        scheduler.add_request(_request(ids, max_new_tokens))
    while scheduler.waiting or any(r.kv_len < r.fill_len - 1 for r in scheduler.running):
        scheduler.step()


def _drain(scheduler) -> None:
    while scheduler.has_work():
        scheduler.step()


def scenarios(scheduler, args, prompt: Callable[[int], list[int]]) -> list[Scenario]:
    """The scenarios of `run_profile`; the extend one only with `args.suffix` > 0."""
    context, streams = args.context, args.streams
    decode_steps = max(4, min(args.decode_tokens, 32))
    add = scheduler.add_request

    extends = []

    def extend_after_cached_prefix() -> None:
        prefix = prompt(context)
        add(_request(prefix, 1))
        _drain(scheduler)                                    # the prefix is in the radix cache now
        add(_request(prefix + prompt(args.suffix), 1))
        extends.append(scheduler.waiting[-1])

    def extended_after_prefix() -> None:
        req = extends[-1]
        if req.cached_tokens < context - scheduler.args.page_size:
            raise RuntimeError(f"the extend step found {req.cached_tokens} of its {context} prefix tokens cached "
                               "(is the radix cache on?)")

    one, many = [prompt(context)], [prompt(context) for _ in range(streams)]
    out = [Scenario(f"prefill {context}", lambda: add(_request(prompt(context), 1)), 1,
                    [prompt(context)], 1)]
    if args.suffix > 0:
        out.append(Scenario(f"extend {args.suffix} after {context}", extend_after_cached_prefix, 1,
                            [prompt(args.suffix)], 1, extended_after_prefix))
    out.append(Scenario("decode 1 stream", lambda: _decode_ready(scheduler, one, decode_steps * 4 + 8),
                        decode_steps, one, decode_steps))
    out.append(Scenario(f"decode {streams} streams", lambda: _decode_ready(scheduler, many, decode_steps * 4 + 8),
                        decode_steps, many, decode_steps))
    return out


def profile_scenario(scheduler, timer: StepTimer, scenario: Scenario, repeat: int) -> dict[str, float]:
    """Seconds per step of each breakdown row for one scenario."""
    per_step: list[dict[str, float]] = []
    for _ in range(repeat + 1):        # the first round warms up
        scenario.start()
        timer.reset()
        for _ in range(scenario.steps):
            scheduler.step()
        per_step.append({k: v / scenario.steps for k, v in timer.totals.items()})
        scenario.verify()
        _drain(scheduler)
    # The fastest round, part by part: on a shared machine the minimum is the least disturbed estimate.
    walls = {k: min(p[k] for p in per_step[1:]) for k in per_step[1]}

    kernels = _profile_steps(scheduler, scenario.steps, scenario.start)
    _drain(scheduler)
    row = {"step": walls["step"], "scheduler": walls["step"] - walls["runner"],
           "batch metadata": walls["runner"] - walls["model"] - walls.get("sampler", 0.0),
           "sampler": walls.get("sampler", 0.0), "model forward": walls["model"]}
    # Ops cannot take longer than the unprofiled forward: where the profiled step ran slower (profiler cost,
    # a busier moment), its op times are scaled down together, which keeps their shares.
    op_total = sum(kernels.values())
    fit = min(1.0, walls["model"] / op_total) if op_total else 1.0
    for name in FORWARD_ROWS[:-1]:
        row[name] = kernels.get(name, 0.0) * fit
    row["Python overhead"] = walls["model"] - op_total * fit
    return row


def engine_step_overhead(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds per decode step that the Engine adds around the scheduler step (queues, result handling)."""
    timer = StepTimer()
    timer.wrap(engine.scheduler, "step", "step")
    greedy = {"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True}
    timer.reset()
    t = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params=greedy)
    wall = time.perf_counter() - t
    steps = new_tokens + len(prompts)    # one prefill step per prompt (chunk == context), then decodes
    return max(0.0, (wall - timer.totals["step"]) / steps)


def format_table(results: dict[str, dict[str, float]]) -> str:
    """Markdown table: ms per step and share of the step per row, one column pair per scenario."""
    names = list(results)
    head = "| part | " + " | ".join(f"{n} ms | {n} share" for n in names) + " |"
    lines = [head, "|---|" + "---|---|" * len(names)]
    rows = ["step", "scheduler", "batch metadata", "sampler", "model forward", *FORWARD_ROWS,
            "IPC/result handling (Engine)"]
    for row in rows:
        cells = []
        for n in names:
            value, step = results[n].get(row, 0.0), results[n]["step"]
            cells.append(f"{value * 1000:.2f} | {100 * value / step:.1f}%")
        label = f"  {row}" if row in FORWARD_ROWS else row
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_profile(args, make_engine: Callable, prompt_maker: Callable) -> dict[str, dict[str, float]]:
    """Every scenario; `make_engine()` builds a fresh kvstrata.Engine with the bench's settings and the radix
    cache on, `prompt_maker(vocab)` a function n -> n random token ids."""
    engine = make_engine()
    prompt = prompt_maker(engine.scheduler.runner.vocab_size)
    scheduler = engine.scheduler
    todo = scenarios(scheduler, args, prompt)
    engine.generate(input_ids=prompt(64), sampling_params={"max_new_tokens": 4})   # warm-up
    overheads = {s.name: engine_step_overhead(engine, s.engine_prompts, s.engine_new_tokens) for s in todo}
    # Stop the engine's loop thread but keep its scheduler: it is driven from this thread from now on
    # (Engine.shutdown would also close the scheduler).
    engine.detach_scheduler()
    timer = _instrument(scheduler)
    results = {}
    try:
        for scenario in todo:
            results[scenario.name] = profile_scenario(scheduler, timer, scenario, args.repeat)
            results[scenario.name]["IPC/result handling (Engine)"] = overheads[scenario.name]
    finally:
        scheduler.close()
    return results
