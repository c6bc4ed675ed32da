"""Control answers reach the caller that asked, matched by the id the scheduler echoes (serving/control.py).

The SchedulerClient talks over its real ZMQ sockets to a scripted scheduler that answers two questions of
one kind in the reverse order: matched by kind, each caller would get the other's answer. The scheduler's
own echo is checked on a real SchedulerLoop over a real Scheduler.
"""

from __future__ import annotations

import asyncio
import tempfile

import zmq
import zmq.asyncio

from kvstrata.args import ServerArgs
from kvstrata.runtime.loop import SchedulerLoop
from kvstrata.runtime.messages import (
    TO_SCHEDULER,
    ControlOut,
    FlushCacheReq,
    GetLoadReq,
    GetStateReq,
    MessageCodec,
    SchedulerReady,
)
from kvstrata.server.scheduler_client import SchedulerClient
from tests.runtime.helpers import make_engine


def _ready(args: ServerArgs) -> SchedulerReady:
    return SchedulerReady(max_total_tokens=256, context_length=128, vocab_size=100, eos_token_ids=[0],
                          max_running_requests=4, page_size=1, server_args=args, tokenizer_fingerprint="")


async def _two_state_calls_answered_out_of_order(ipc_dir: str) -> tuple[dict, dict]:
    to_scheduler, from_scheduler = f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out"
    ctx = zmq.asyncio.Context()
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind(to_scheduler)
    outbox.bind(from_scheduler)
    args = ServerArgs(model_path="tiny")
    client = SchedulerClient(args, None, _ready(args), to_scheduler, from_scheduler)
    client.start()
    try:
        full = asyncio.ensure_future(client.get_state(full=True))
        light = asyncio.ensure_future(client.get_state(full=False))
        codec = MessageCodec(TO_SCHEDULER)       # the scheduler's side of the wire
        asked = [codec.decode(await asyncio.wait_for(inbox.recv(), 10)) for _ in range(2)]
        assert all(isinstance(m, GetStateReq) for m in asked)
        assert len({m.control_id for m in asked}) == 2          # each question has its own id
        for msg in reversed(asked):                              # the later question is answered first
            await outbox.send(codec.encode(ControlOut("state", True, "", {"full": msg.full},
                                                      control_id=msg.control_id)))
        return await asyncio.wait_for(full, 10), await asyncio.wait_for(light, 10)
    finally:
        await client.close()
        inbox.close(0)
        outbox.close(0)
        ctx.term()


def test_two_control_calls_of_one_kind_each_get_their_own_answer():
    with tempfile.TemporaryDirectory() as ipc_dir:
        full, light = asyncio.run(_two_state_calls_answered_out_of_order(ipc_dir))
    assert full == {"full": True}
    assert light == {"full": False}


def test_scheduler_loop_echoes_each_control_id():
    """The real SchedulerLoop over a real Scheduler answers every control question with the asker's id."""
    scheduler = make_engine(disable_radix_cache=True, max_total_tokens=512).detach_scheduler()
    asked = [GetStateReq(control_id=7, full=False), GetLoadReq(control_id=8), FlushCacheReq(control_id=9),
             GetStateReq(control_id=10)]
    inbox, answers = [asked], []
    try:
        loop = SchedulerLoop(scheduler, lambda block: inbox.pop() if inbox else [], answers.append)
        loop.run_once()
    finally:
        scheduler.close()
    assert [(a.kind, a.control_id) for a in answers] == [("state", 7), ("load", 8), ("flush_cache", 9),
                                                         ("state", 10)]
    assert all(a.success for a in answers)
