"""The scheduler/model process of the HTTP server: a SchedulerLoop over ZMQ sockets.

The frontend PUSHes messages (runtime/messages.py) to `recv_addr` and PULLs outputs from `send_addr`;
this process binds both. They travel as typed msgpack frames (messages.MessageCodec: a frame that is not one
of the frontend's requests, or whose fields do not check, is logged and dropped); the sockets are ipc:// files
in a 0700 directory of the frontend's (server/launch.py), made 0600 here. Start-up result goes through `ready_conn`: a SchedulerReady (with the ServerArgs
resolved here, where torch is), a ConfigError, or an error string (and a non-zero exit).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from typing import TYPE_CHECKING, Optional

import zmq

from kvstrata.args import ConfigError, ServerArgs
from kvstrata.model.light_tokenizer import fingerprint
from kvstrata.model.parallel import RankFailure
from kvstrata.platform import return_free_heap
from kvstrata.runtime.handoff import HandoffFactory
from kvstrata.runtime.heartbeat import Heartbeat
from kvstrata.runtime.loop import SchedulerLoop
from kvstrata.runtime.messages import TO_SCHEDULER, MessageCodec, MessageRejected, SchedulerReady
from kvstrata.runtime.ranks import RANK_FAILED_EXIT_CODE

if TYPE_CHECKING:
    from kvstrata.runtime.scheduler import Scheduler

logger = logging.getLogger(__name__)


def run_scheduler_process(server_args: ServerArgs, recv_addr: str, send_addr: str, ready_conn,
                          heartbeat: Optional[Heartbeat] = None,
                          handoff_factory: Optional[HandoffFactory] = None) -> None:
    """Process entry point: load the model, report readiness, serve until the frontend goes away; beats
    `heartbeat` once per loop iteration. `handoff_factory`: the PD handoff of the server's mode, if any."""
    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s scheduler] %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the frontend decides when we stop (SIGTERM)
    try:
        server_args = server_args.resolve()
    except ConfigError as e:     # e.g. --device cuda without CUDA: the frontend reports it as a flag error
        ready_conn.send(e)
        ready_conn.close()
        sys.exit(1)
    ctx = zmq.Context()
    try:
        from kvstrata.runtime.scheduler import Scheduler

        scheduler = Scheduler(server_args, handoff_factory=handoff_factory)
        pull = ctx.socket(zmq.PULL)
        pull.bind(recv_addr)
        push = ctx.socket(zmq.PUSH)
        push.bind(send_addr)
        for addr in (recv_addr, send_addr):
            owner_only(addr)
        return_free_heap()    # start-up's freed memory (imports, the load's small buffers) leaves the RSS
    except Exception as e:
        logger.error("scheduler failed to start: %s", traceback.format_exc())
        ready_conn.send(f"scheduler failed to start: {e}")
        ready_conn.close()
        sys.exit(1)

    if heartbeat is not None:
        heartbeat.beat()      # loading the model took long: the clock /health reads starts now
    ready_conn.send(ready_message(scheduler))
    ready_conn.close()
    parent = os.getppid()

    codec = MessageCodec(TO_SCHEDULER)

    def recv(block: bool) -> list:
        msgs = []
        if block and not pull.poll(timeout=100):
            if os.getppid() != parent:      # frontend died without telling us
                loop.stop()
            return msgs
        while True:
            try:
                msgs.append(codec.decode(pull.recv(flags=zmq.NOBLOCK)))
            except MessageRejected as e:
                logger.warning("dropped a message: %s", e)
            except zmq.Again:
                return msgs

    loop = SchedulerLoop(scheduler, recv, lambda msg: push.send(codec.encode(msg)),
                         heartbeat.beat if heartbeat else lambda: None)
    signal.signal(signal.SIGTERM, lambda *_: loop.stop())
    failure = None
    try:
        loop.run()
    except RankFailure as e:
        failure = e
    finally:
        scheduler.close()
        pull.close(linger=0)
        push.close(linger=0)
        ctx.term()
    if failure is not None:     # exit at once and non-zero: the HTTP process sees it and turns /health 503
        logger.error("the tensor-parallel group failed: %s; the scheduler stops", failure)
        logging.shutdown()
        os._exit(RANK_FAILED_EXIT_CODE)


def owner_only(addr: str) -> None:
    """Make an ipc:// socket file readable and writable by its owner only (its directory is 0700 too): no
    other user may send the scheduler requests or read its outputs."""
    if addr.startswith("ipc://"):
        os.chmod(addr.removeprefix("ipc://"), 0o600)


def ready_message(scheduler: Scheduler) -> SchedulerReady:
    """What a frontend needs to know about a started scheduler (limits, vocabulary, eos ids, resolved args)."""
    runner, args = scheduler.runner, scheduler.args
    return SchedulerReady(
        max_total_tokens=runner.max_total_tokens, context_length=runner.context_len,
        vocab_size=runner.vocab_size, eos_token_ids=list(runner.config.eos_token_ids),
        max_running_requests=args.max_running_requests, page_size=args.page_size, server_args=args,
        tokenizer_fingerprint=fingerprint(scheduler.tokenizer))
