"""Start and stop the server: the scheduler/model process, then FastAPI on uvicorn in this process.

Shutdown on SIGINT/SIGTERM: uvicorn stops serving, then the scheduler process is terminated and joined.
The scheduler also dies with this process if it is killed outright (PR_SET_PDEATHSIG on Linux).
If the scheduler dies, /health answers 503 and this process exits non-zero after a short grace period; so
it does when the scheduler is stuck past --watchdog-timeout (server/scheduler_watch.py kills it first).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import functools
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any, Optional

from kvstrata.args import ConfigError, ServerArgs
from kvstrata.platform import return_free_heap
from kvstrata.runtime.heartbeat import Heartbeat

logger = logging.getLogger(__name__)

EXIT_GRACE_S = 2.0          # time /health answers 503 before the process exits after a scheduler death
STOP_TIMEOUT_S = 10.0
SNAPSHOT_STOP_TIMEOUT_S = 120.0    # writing the L2 snapshot: ~6-7 s per GB of host pool measured (copy + hash + disk)
SCHEDULER_DIED_EXIT_CODE = 3
IPC_PREFIX = "kvstrata-ipc-"     # + the owning server's pid + "-" + a random suffix


class _Shutdown(SystemExit):
    """Raised by our SIGTERM handler once uvicorn has finished its graceful shutdown."""


def main(argv: Optional[list[str]] = None) -> int:
    """`python -m kvstrata.launch_server` / `kvstrata serve`: run the server until stopped; returns the exit code."""
    parser = argparse.ArgumentParser(prog="kvstrata serve", description="Run the kvstrata HTTP server.")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs.from_cli_args(ns).resolve(with_device=False)   # the scheduler resolves the device
    except ConfigError as e:
        parser.error(str(e))
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    for note in args.no_effect_notes():
        logger.warning("%s", note)
    if args.node_rank > 0:     # no HTTP server on this node: its tensor-parallel ranks follow rank 0's plans
        from kvstrata.runtime.ranks import run_node

        return run_node(args.resolve())
    signal.signal(signal.SIGTERM, _raise_shutdown)
    try:
        return serve(args)
    except ConfigError as e:       # found by the scheduler process (device settings)
        parser.error(str(e))
    except _Shutdown:
        return 0
    except KeyboardInterrupt:
        return 0


def run_and_exit(argv: Optional[list[str]] = None) -> None:
    """main(argv), then exit the process with its code (fast: everything is stopped by then)."""
    exit_now(main(argv))


def serve(args: ServerArgs) -> int:
    """Run the server with resolved `args`; returns the exit code."""
    import uvicorn

    from kvstrata.model.builtin import resolve_model_path
    from kvstrata.model.config import ModelLoadError
    from kvstrata.model.tokenizer import TokenizerLoadError, confirm_light_tokenizer, load_light_tokenizer
    from kvstrata.server.app import create_app
    from kvstrata.server.connections import (
        ConnectionGuard,
        GuardedH11Protocol,
        accept_backlog,
        default_max_connections,
        file_limit,
    )
    from kvstrata.server.drain import DrainingServer, drain
    from kvstrata.server.scheduler_client import SchedulerClient
    from kvstrata.server.scheduler_watch import SchedulerWatch

    sock = bind_http_socket(args.host, args.port)
    remove_stale_ipc_dirs()
    ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")   # 0700: only this user reaches the sockets
    os.chmod(ipc_dir, 0o700)          # whatever the platform's mkdtemp did
    recv_addr, send_addr = f"ipc://{ipc_dir}/to-scheduler", f"ipc://{ipc_dir}/from-scheduler"
    proc = None
    try:
        prepare_model_folders(args)
        tokenizer_dir = resolve_model_path(args.tokenizer_path or args.model_path)
        proc, ready_conn, heartbeat = spawn_scheduler(args, recv_addr, send_addr)
        # While the scheduler loads the model; no transformers (and so no torch) in this process.
        tokenizer = load_light_tokenizer(tokenizer_dir, args.chat_template)
        info = wait_scheduler_ready(proc, ready_conn)
        args = info.server_args       # with device, dtype and chunk size resolved
        tokenizer = confirm_light_tokenizer(tokenizer, info.tokenizer_fingerprint, tokenizer_dir, args.chat_template)
        client = SchedulerClient(args, tokenizer, info, recv_addr, send_addr)
        exit_code = {"value": 0}
        server: Any = None

        def on_scheduler_death() -> None:
            exit_code["value"] = SCHEDULER_DIED_EXIT_CODE
            asyncio.get_running_loop().call_later(EXIT_GRACE_S, lambda: setattr(server, "should_exit", True))

        watch = SchedulerWatch(proc, heartbeat, args.scheduler_heartbeat_timeout, args.watchdog_timeout or None)
        limit = file_limit()
        guard = ConnectionGuard(args.max_connections or default_max_connections(limit), args.header_read_timeout)
        app = create_app(client, watch, on_scheduler_death, guard)
        logger.info("HTTP connections: at most %d open, %g s to send request headers", guard.max_connections,
                    guard.header_read_timeout_s)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5, access_log=False,
                                timeout_keep_alive=30, http=functools.partial(GuardedH11Protocol, guard=guard),
                                backlog=accept_backlog(limit))
        server = DrainingServer(config, on_drain=lambda: drain(client, args.graceful_shutdown_timeout))
        return_free_heap()    # what loading the tokenizer freed (its JSON parse: ~14 MB for SmolLM2's)
        server.run(sockets=[sock])
        return exit_code["value"]
    except (SchedulerStartError, TokenizerLoadError, ModelLoadError) as e:
        logger.error("%s", e)
        return 1
    finally:
        sock.close()
        if proc is not None:
            stop_scheduler(proc, SNAPSHOT_STOP_TIMEOUT_S if args.hicache_snapshot_path else STOP_TIMEOUT_S)
        shutil.rmtree(ipc_dir, ignore_errors=True)


def prepare_model_folders(args: ServerArgs) -> None:
    """Build the built-in models and convert the GGUF files that `args` names, once, in a child process, and
    record transformers' tokenizer fingerprint of the tokenizer folder (tokenizer_check.py) if none is yet.

    Both need torch and transformers, which this process should never import and the scheduler should not keep
    resident. Doing it here, before the scheduler starts, also keeps two processes from building the same folder
    at once.
    """
    from kvstrata.model.builtin import is_model_folder_ready, resolve_model_path
    from kvstrata.model.tokenizer_check import needs_record, record_fingerprint

    tokenizer_name = args.tokenizer_path or args.model_path
    names = list(dict.fromkeys([tokenizer_name, args.model_path]))
    if all(is_model_folder_ready(name) for name in names) and not needs_record(resolve_model_path(tokenizer_name)):
        return
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        pool.map(resolve_model_path, names)
        tokenizer_dir = resolve_model_path(tokenizer_name)    # built by now
        if needs_record(tokenizer_dir):
            pool.apply(record_fingerprint, (tokenizer_dir,))


def remove_stale_ipc_dirs(tmp_dir: Optional[str] = None) -> list[str]:
    """Delete IPC directories left by servers that died without cleaning up (kill -9); returns them."""
    tmp_dir = tmp_dir or tempfile.gettempdir()
    removed = []
    for name in os.listdir(tmp_dir):
        owner = name[len(IPC_PREFIX):].split("-", 1)[0] if name.startswith(IPC_PREFIX) else ""
        if owner.isdigit() and not _pid_alive(int(owner)):
            shutil.rmtree(os.path.join(tmp_dir, name), ignore_errors=True)
            removed.append(name)
    if removed:
        logger.info("removed %d stale IPC directories: %s", len(removed), ", ".join(removed))
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True      # exists, owned by someone else
    return True


class SchedulerStartError(RuntimeError):
    """The scheduler process exited or reported an error before it was ready."""


def spawn_scheduler(args: ServerArgs, recv_addr: str, send_addr: str) -> tuple[Any, Any, Heartbeat]:
    """Start the scheduler process; returns it, the pipe end its start-up result arrives on and its heartbeat."""
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    heartbeat = Heartbeat(ctx)
    proc = ctx.Process(target=_scheduler_main, args=(args, recv_addr, send_addr, writer, os.getpid(), heartbeat),
                       name="kvstrata-scheduler", daemon=False)   # it starts the --tp-size ranks: not a daemon
    # It still never outlives this process: PR_SET_PDEATHSIG, and stop_scheduler in serve()'s finally.
    proc.start()
    writer.close()
    return proc, reader, heartbeat


def wait_scheduler_ready(proc: Any, reader: Any) -> Any:
    """Wait for the scheduler's SchedulerReady; raises ConfigError for settings the scheduler refused, and
    SchedulerStartError if it fails otherwise or exits first."""
    from kvstrata.runtime.messages import SchedulerReady

    try:
        while not reader.poll(0.2):
            if not proc.is_alive():
                raise SchedulerStartError(f"the scheduler process exited with code {proc.exitcode} before it "
                                          f"was ready")
        msg = reader.recv()
    except (EOFError, OSError):
        proc.join(5)
        raise SchedulerStartError(f"the scheduler process exited with code {proc.exitcode} before it was "
                                  f"ready") from None
    finally:
        reader.close()
    if isinstance(msg, ConfigError):
        raise msg
    if not isinstance(msg, SchedulerReady):
        raise SchedulerStartError(str(msg))
    logger.info("scheduler ready (pid %d): %s", proc.pid, msg)
    return msg


def stop_scheduler(proc: Any, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Terminate the scheduler process and wait for it; kill it if it does not stop in time."""
    logger.info("stopping the scheduler process (pid %d)", proc.pid)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout_s)
    if proc.is_alive():
        logger.warning("scheduler process %d did not stop; killing it", proc.pid)
        proc.kill()
        proc.join(STOP_TIMEOUT_S)
    else:
        proc.join(0)
    logger.info("scheduler process stopped (exit code %s)", proc.exitcode)


def _scheduler_main(args: ServerArgs, recv_addr: str, send_addr: str, ready_conn: Any, parent_pid: int,
                    heartbeat: Heartbeat) -> None:
    """Entry point of the spawned process: die with the parent, then run the scheduler."""
    _die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the whole group; the parent decides
    from kvstrata.disagg import handoff_for
    from kvstrata.runtime.scheduler_process import run_scheduler_process

    run_scheduler_process(args, recv_addr, send_addr, ready_conn, heartbeat, handoff_for(args.disaggregation_mode))
    exit_now(0)


def exit_now(code: int) -> None:
    """Exit without interpreter teardown, which takes seconds once torch and transformers are loaded.

    Only for processes whose work is fully stopped: logs and stdio are flushed, nothing else runs.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            pr_set_pdeathsig = 1
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL))
        except OSError:
            pass
    if os.getppid() != parent_pid:   # the parent died before prctl took effect
        os._exit(1)


def bind_http_socket(host: str, port: int) -> socket.socket:
    """Bind the HTTP socket before loading the model, so that a busy port fails fast; listen only later.

    uvicorn listens on it once the scheduler is ready. Until then a client (a readiness probe during a
    multi-GB L2 snapshot load) gets "connection refused" at once, not a connection that nobody answers.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(False)
    return sock


def _raise_shutdown(signum: int, frame: Any) -> None:
    raise _Shutdown(0)
