"""The PD handshake fields of a request body (SGLang's names): bootstrap_host, bootstrap_port, bootstrap_room.

A PD router adds them to the body it sends to a prefill and a decode server (native /generate and the
OpenAI endpoints alike). Here they are only parsed and type-checked; whether this server may serve them
(its --disaggregation-mode, rooms in use) is the scheduler's decision.
"""

from __future__ import annotations

from typing import Optional

from kvstrata.runtime.messages import BootstrapInfo
from kvstrata.serving.errors import ApiError
from kvstrata.serving.protocol import GenerateRequest, check_int

FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
MAX_ROOM = 2 ** 63 - 1


def parse_bootstrap(body: dict) -> Optional[BootstrapInfo]:
    """The request's BootstrapInfo, None when it has none of the fields; ApiError(400) when malformed."""
    given = {name: body.get(name) for name in FIELDS if body.get(name) is not None}
    if not given:
        return None
    missing = [name for name in FIELDS if name not in given]
    if missing:
        raise ApiError(f"PD disaggregation needs all of {', '.join(FIELDS)}; missing {', '.join(missing)}",
                       param=missing[0])
    if any(isinstance(v, list) for v in given.values()):
        raise ApiError("batch requests with bootstrap fields are not supported; send one prompt per request",
                       param="bootstrap_room")
    host = given["bootstrap_host"]
    if not isinstance(host, str) or not host:
        raise ApiError("'bootstrap_host' must be a non-empty string", param="bootstrap_host")
    port = check_int(given["bootstrap_port"], "bootstrap_port", lo=1, hi=65535)
    room = check_int(given["bootstrap_room"], "bootstrap_room", lo=0, hi=MAX_ROOM)
    return BootstrapInfo(host, port, room)


def attach_bootstrap(body: dict, req: GenerateRequest) -> None:
    """Put the body's BootstrapInfo (if any) on `req`; one prompt and n == 1 only."""
    info = parse_bootstrap(body)
    if info is None:
        return
    if len(req.prompts) != 1 or req.prompts[0].sampling.n != 1:
        raise ApiError("a request with bootstrap_room must have exactly one prompt and n == 1",
                       param="bootstrap_room")
    req.extra["bootstrap"] = info
