"""Signed frames of the PD bootstrap channel: what is admitted and what is dropped (and why)."""

from __future__ import annotations

import os
import pickle
import time

import msgspec
import pytest
import zmq

from kvstrata.args import ConfigError, ServerArgs
from kvstrata.disagg.channel import BootstrapChannel
from kvstrata.disagg.messages import KVLayout, KVTransferAbort, KVTransferDone, KVTransferRequest, ShardTarget
from kvstrata.disagg.wire import MAC_BYTES, MAGIC, Envelope, FrameCodec, FrameRejected

SECRET = "s3cret"


TARGET = ShardTarget("127.0.0.1:15000", [4096, 8192], [12288, 16384])


def request(**changes) -> KVTransferRequest:
    fields = dict(room=7, reply_to="tcp://127.0.0.1:5555", layout=KVLayout(2, 2, 4, "float32"), shards=[TARGET],
                  prompt_len=6, prompt_digest="0" * 32, start_token=2, dst_slots=[8, 9, 10, 11],
                  deadline=time.time() + 5)
    return KVTransferRequest(**{**fields, **changes})


class _Exploit:
    def __reduce__(self):
        return os.system, ("touch /tmp/kvstrata-wire-test-pwned",)


def rejected(codec: FrameCodec, frame: bytes) -> str:
    with pytest.raises(FrameRejected) as e:
        codec.decode(frame)
    return e.value.reason


def test_round_trip_keeps_every_field():
    codec = FrameCodec(SECRET)
    tp2 = request(layout=KVLayout(2, 1, 4, "bfloat16", page_size=16, tp_size=2),
                  shards=[TARGET, ShardTarget("127.0.0.1:15001", [1 << 40, 2 << 40], [3 << 40, 4 << 40])])
    for msg in (request(), tp2, KVTransferAbort(3, "timeout"),
                KVTransferDone(5, 42, -0.5, [(-0.5, 42), (-1.5, 7)], 1024, 0.01, 3)):
        assert FrameCodec(SECRET).decode(codec.encode(msg)) == msg


def test_pickle_garbage_and_unsigned_msgpack_are_malformed_or_unauthenticated():
    codec = FrameCodec(SECRET)
    assert rejected(codec, pickle.dumps(_Exploit())) == "malformed"
    assert rejected(codec, b"") == "malformed"
    assert rejected(codec, os.urandom(300)) == "malformed"
    body = msgspec.msgpack.encode(Envelope(time.time(), os.urandom(16), request()))
    assert rejected(codec, MAGIC + body) == "unauthenticated"           # no MAC at all
    assert rejected(codec, MAGIC + pickle.dumps(_Exploit()) * 2) == "unauthenticated"
    assert not os.path.exists("/tmp/kvstrata-wire-test-pwned")


def test_wrong_or_missing_secret_and_tampering_are_unauthenticated():
    codec = FrameCodec(SECRET)
    assert rejected(codec, FrameCodec("another").encode(request())) == "unauthenticated"
    assert rejected(codec, FrameCodec(None).encode(request())) == "unauthenticated"
    frame = bytearray(FrameCodec(SECRET).encode(request()))
    frame[len(MAGIC) + MAC_BYTES + 20] ^= 1
    assert rejected(codec, bytes(frame)) == "unauthenticated"


def test_replayed_and_stale_frames_are_dropped():
    codec = FrameCodec(SECRET, window_s=60)
    frame = FrameCodec(SECRET).encode(KVTransferAbort(1, "x"))
    assert codec.decode(frame) == KVTransferAbort(1, "x")
    assert rejected(codec, frame) == "replayed"
    old = msgspec.msgpack.encode(Envelope(time.time() - 3600, os.urandom(16), KVTransferAbort(1, "x")))
    signer = FrameCodec(SECRET)
    assert rejected(codec, MAGIC + signer._mac(old) + old) == "stale"


@pytest.mark.parametrize("changes", [
    {"room": -1}, {"room": 2 ** 63}, {"shards": [ShardTarget(TARGET.session_id, [1], TARGET.v_ptrs)]},
    {"shards": [ShardTarget(TARGET.session_id, [-4, 8], TARGET.v_ptrs)]}, {"start_token": 7},
    {"shards": []}, {"shards": [TARGET, TARGET]}, {"layout": KVLayout(2, 2, 4, "float32", tp_size=2)},
    {"shards": [TARGET, ShardTarget(TARGET.session_id, [1, 2, 3], TARGET.v_ptrs)],
     "layout": KVLayout(2, 2, 4, "float32", tp_size=2)}, {"layout": KVLayout(2, 2, 4, "float32", tp_size=0)},
    {"dst_slots": [8, 9, 10]}, {"dst_slots": [8, 9, 10, -1]}, {"prompt_len": 0}, {"deadline": float("nan")},
    {"reply_to": "ipc:///tmp/x"}, {"reply_to": "tcp://a b:1"}, {"shards": [ShardTarget("x" * 300 + ":1", TARGET.k_ptrs, TARGET.v_ptrs)]},
    {"prompt_digest": "zz"}, {"layout": KVLayout(2, 2, 4, "object")}, {"layout": KVLayout(0, 2, 4, "float32")},
])
def test_out_of_range_or_inconsistent_fields_are_invalid(changes):
    assert rejected(FrameCodec(SECRET), FrameCodec(SECRET).encode(request(**changes))) == "invalid"


def test_oversized_lists_are_invalid_before_use():
    done = KVTransferDone(1, 2, None, [(-1.0, 3)] * 2000)
    assert rejected(FrameCodec(SECRET), FrameCodec(SECRET).encode(done)) == "invalid"
    assert rejected(FrameCodec(SECRET), FrameCodec(SECRET).encode(KVTransferDone(1, -5))) == "invalid"


def test_channel_drops_and_counts_what_it_cannot_admit():
    inbox = BootstrapChannel("127.0.0.1", secret=SECRET)
    peer = BootstrapChannel("127.0.0.1", secret=SECRET)
    stranger = zmq.Context.instance().socket(zmq.PUSH)
    try:
        stranger.connect(inbox.address)
        stranger.send(pickle.dumps(_Exploit()))
        stranger.send(FrameCodec("wrong").encode(KVTransferAbort(1, "forged")))
        peer.send(inbox.address, KVTransferAbort(2, "genuine"))
        got: list = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (not got or sum(inbox.rejected.values()) < 2):
            got += inbox.receive()
            time.sleep(0.01)
        assert got == [KVTransferAbort(2, "genuine")]
        assert inbox.rejected["malformed"] == 1 and inbox.rejected["unauthenticated"] == 1
        assert not os.path.exists("/tmp/kvstrata-wire-test-pwned")
    finally:
        stranger.close(0)
        inbox.close()
        peer.close()


def test_pd_server_off_loopback_needs_a_secret_and_a_routable_advertise_host(monkeypatch):
    monkeypatch.delenv("KVSTRATA_DISAGGREGATION_SECRET", raising=False)
    ServerArgs(disaggregation_mode="prefill").resolve(with_device=False)      # loopback: allowed
    with pytest.raises(ConfigError, match="disaggregation-secret"):
        ServerArgs(disaggregation_mode="decode", host="10.1.2.3").resolve(with_device=False)
    strong = "x" * 16
    with pytest.raises(ConfigError, match="advertise-host"):
        ServerArgs(disaggregation_mode="decode", host="0.0.0.0", disaggregation_secret=strong).resolve(with_device=False)
    with pytest.raises(ConfigError, match="must be an IP address"):
        ServerArgs(disaggregation_mode="decode", disaggregation_advertise_host="pd.example", disaggregation_secret=strong
                   ).resolve(with_device=False)
    with pytest.raises(ConfigError, match="at least 16 characters"):
        ServerArgs(disaggregation_mode="decode", disaggregation_secret="short").resolve(with_device=False)
    args = ServerArgs(disaggregation_mode="decode", host="0.0.0.0", disaggregation_advertise_host="10.1.2.3",
                      disaggregation_secret=strong).resolve(with_device=False)
    assert args.disaggregation_host() == "10.1.2.3"
    ServerArgs(host="0.0.0.0").resolve(with_device=False)                      # co-located: no PD sockets
    monkeypatch.setenv("KVSTRATA_DISAGGREGATION_SECRET", "from-env-0123456789")
    args = ServerArgs(disaggregation_mode="decode", host="10.1.2.3").resolve(with_device=False)
    assert args.disaggregation_secret == "from-env-0123456789"
    assert "from-env" not in repr(args) and args.to_dict()["disaggregation_secret"] == "***"
