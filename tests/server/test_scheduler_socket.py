"""The frontend <-> scheduler sockets carry typed msgpack frames, never pickles (runtime/messages.py).

A process of the server's own user can reach the scheduler's ipc:// socket: a pickle, garbage, a frame of a
type the scheduler does not accept and one whose fields do not check are dropped, nothing runs, and the
server goes on answering with the same tokens.
"""

from __future__ import annotations

import glob
import os
import pickle
import tempfile
import time

import msgspec
import requests
import zmq

from kvstrata.runtime.messages import TO_FRONTEND, BatchOutput, MessageCodec, MessageRejected
from tests.net_probe import exploit_pickle


def _greedy(server) -> list[int]:
    body = {"text": "The socket test", "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    resp = requests.post(server.url + "/generate", json=body, headers=server.headers, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["output_ids"]


def test_pickles_and_bad_frames_on_the_scheduler_socket_run_nothing(server, tmp_path):
    before = _greedy(server)
    sockets = glob.glob(os.path.join(tempfile.gettempdir(), f"kvstrata-ipc-{server.proc.pid}-*", "to-scheduler"))
    assert len(sockets) == 1, sockets
    marker = tmp_path / "pwned"
    frames = [
        exploit_pickle(str(marker)),
        os.urandom(256),
        b"",
        msgspec.msgpack.encode(["BatchOutput", {"outputs": []}]),              # the scheduler's own type
        msgspec.msgpack.encode(["AbortReq", {"rid": 7}]),                      # a field of the wrong type
        msgspec.msgpack.encode(["TokenizedGenerateReq", {"rid": "x"}]),        # fields missing
    ]
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    try:
        sock.connect(f"ipc://{sockets[0]}")
        for frame in frames:
            sock.send(frame)
        time.sleep(1.0)
    finally:
        sock.close()
        ctx.term()
    assert not marker.exists(), "a pickle sent to the scheduler's socket ran"
    assert _greedy(server) == before
    assert server.proc.poll() is None


def test_the_frontend_side_rejects_what_it_does_not_accept():
    codec = MessageCodec(TO_FRONTEND)
    assert codec.decode(codec.encode(BatchOutput([]))) == BatchOutput([])
    for frame in (pickle.dumps(BatchOutput([])), msgspec.msgpack.encode(["AbortReq", {"rid": "a"}]),
                  msgspec.msgpack.encode(["BatchOutput", {"outputs": [{"rid": 1}]}])):
        try:
            codec.decode(frame)
        except MessageRejected:
            continue
        raise AssertionError(f"accepted {frame[:40]!r}")
