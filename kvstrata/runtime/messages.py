"""Typed messages between the HTTP/tokenizer side and the scheduler (over ZMQ, or a queue in-process).

Every message carries the request id (`rid`) it concerns. Direction is in the class docstring. Over ZMQ they
travel as msgpack frames `[class name, fields]` (MessageCodec): the receiving side names the classes it
accepts, and msgspec checks every field's type as it decodes. Nothing is unpickled: the sockets are owner-only
files, but any process of the server's user can reach them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import msgspec

from kvstrata.args import ServerArgs
from kvstrata.runtime.sampling_params import SamplingParams


@dataclass
class TokenizedGenerateReq:
    """frontend → scheduler: one generation (n is already expanded by the frontend: n == 1 here)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1        # first prompt position whose logprob is returned; -1: none
    top_logprobs_num: int = 0
    stream: bool = False
    cache_namespace: Optional[str] = None  # requests in different namespaces never share KV
    priority: Optional[int] = None     # the client's `priority` as given (the scheduler interprets it)
    bootstrap: Optional[BootstrapInfo] = None  # set when a PD router sent the request (disaggregation)


@dataclass
class AbortReq:
    """frontend → scheduler: stop a request (client gone or /abort_request) and free its KV."""

    rid: str


@dataclass
class ControlReq:
    """frontend → scheduler: a control question; its ControlOut answer echoes `control_id`, which is what
    the asking side matches the answer by (two questions of one kind may be in flight at once)."""

    control_id: int = field(default=0, kw_only=True)    # set by the asking side (serving/control.py)


@dataclass
class FlushCacheReq(ControlReq):
    """frontend → scheduler: empty the prefix cache (refused while requests run)."""


@dataclass
class GetStateReq(ControlReq):
    """frontend → scheduler: ask for internal state and metrics (for /server_info)."""

    full: bool = True        # False: without the idle accounting check and the L1 tree's metrics


@dataclass
class PrefetchReq:
    """frontend → scheduler: a hint to load a prompt's cached prefix closer (POST /prefetch; no answer)."""

    input_ids: list[int]
    cache_namespace: Optional[str] = None


@dataclass
class GetLoadReq(ControlReq):
    """frontend → scheduler: ask for the O(1) load report (for the router's GET /load)."""


EXPERT_RECORD_ACTIONS = ("start", "stop", "dump")


@dataclass
class ExpertDistributionReq(ControlReq):
    """frontend → scheduler: start (clearing the counts), stop or dump the expert distribution recorder
    (--expert-distribution-recorder-mode; the answer's state is the recorder's dump)."""

    action: str = "dump"               # one of EXPERT_RECORD_ACTIONS


@dataclass
class ControlOut:
    """scheduler → frontend: the answer to one ControlReq (FlushCacheReq / GetStateReq / GetLoadReq /
    ExpertDistributionReq)."""

    kind: str                          # "flush_cache" | "state" | "load" | "expert_distribution"
    success: bool = True
    message: str = ""
    state: dict[str, Any] = field(default_factory=dict)
    control_id: int = 0                # the ControlReq's, echoed


@dataclass
class ReqOutput:
    """scheduler → frontend: what one request produced since its previous ReqOutput (deltas)."""

    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: Optional[dict]      # {"type": "stop", "matched": ...} | {"type": "length", "length": n} | abort
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    output_token_logprobs: list[tuple[float, int]] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    # Sent once, with the first output of a request that asked for logprobs.
    input_token_logprobs: Optional[list[tuple[Optional[float], int]]] = None
    input_top_logprobs: Optional[list[Optional[list[tuple[float, int]]]]] = None
    error: Optional[str] = None        # set when the scheduler rejected or failed the request
    error_status: int = 400            # HTTP status the frontend should answer `error` with


@dataclass
class SchedulerReady:
    """scheduler → frontend (once, over the start-up pipe): the model is loaded and the loop is running."""

    max_total_tokens: int
    context_length: int
    vocab_size: int
    eos_token_ids: list[int]
    max_running_requests: int
    page_size: int
    server_args: ServerArgs = field(repr=False)   # resolved here: device, dtype and chunk size need torch
    tokenizer_fingerprint: str          # of the scheduler's tokenizer (light_tokenizer.fingerprint)


@dataclass
class BatchOutput:
    """scheduler → frontend: all ReqOutputs of one scheduler step."""

    outputs: list[ReqOutput]


@dataclass(frozen=True)
class BootstrapInfo:
    """The PD handshake fields of a request (SGLang's names): which prefill serves it, and its room id."""

    host: str                          # the prefill server's host
    port: int                          # its --disaggregation-bootstrap-port
    room: int                          # unique per request across the prefill and decode servers

    @property
    def address(self) -> str:
        """ZMQ address of the prefill's bootstrap service."""
        return f"tcp://{self.host}:{self.port}"


class MessageRejected(ValueError):
    """A frame that is not one of the receiving side's message types, or whose fields do not check."""


class MessageCodec:
    """msgpack frames `[class name, fields]` for one side of the frontend <-> scheduler sockets."""

    def __init__(self, accepts: tuple[type, ...]):
        self._encoder = msgspec.msgpack.Encoder()
        self._frame = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
        self._decoders = {cls.__name__: msgspec.msgpack.Decoder(cls) for cls in accepts}

    def encode(self, msg: Any) -> bytes:
        """One message as a frame."""
        return self._encoder.encode((type(msg).__name__, msg))

    def decode(self, frame: bytes) -> Any:
        """The message in `frame`, typed and checked; MessageRejected names what is wrong."""
        try:
            kind, body = self._frame.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise MessageRejected(f"not a message frame: {e}") from None
        decoder = self._decoders.get(kind)
        if decoder is None:
            raise MessageRejected(f"unexpected message type {kind[:64]!r}")
        try:
            return decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise MessageRejected(f"{kind}: {e}") from None


# What each side accepts: the scheduler the frontend's requests, the frontend the scheduler's outputs.
TO_SCHEDULER = (TokenizedGenerateReq, AbortReq, FlushCacheReq, GetStateReq, PrefetchReq, GetLoadReq,
                ExpertDistributionReq)
TO_FRONTEND = (BatchOutput, ControlOut)
