"""SGLang's expert distribution recorder routes (admin actions; GET or POST, as SGLang takes them):

    /start_expert_distribution_record   clear the counts and count the rows routed to each (layer, expert)
    /stop_expert_distribution_record    stop counting (the counts stay)
    /dump_expert_distribution_record    the counts as JSON: {"logical_count": [layer][expert], ...}

The scheduler owns the recorder (Scheduler.expert_distribution) and refuses, naming why, when the server
runs without --expert-distribution-recorder-mode stat or its model has no MoE layers: a 400 here.
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse

from kvstrata.runtime.messages import ControlOut
from kvstrata.server.scheduler_client import SchedulerClient
from kvstrata.serving.errors import ApiError
from kvstrata.web.auth import require_admin

METHODS = ["GET", "POST"]


def register_expert_record_api(app: FastAPI, client: SchedulerClient) -> None:
    """Add the start / stop / dump expert distribution routes to the worker's app."""

    async def ask(request: Request, action: str) -> ControlOut:
        require_admin(request, client.args.admin_api_key)
        out = await client.expert_distribution(action)
        if not out.success:
            raise ApiError(out.message, 400)
        return out

    @app.api_route("/start_expert_distribution_record", methods=METHODS)
    async def start_expert_distribution_record(request: Request) -> PlainTextResponse:
        """Clear the expert counts and count every forward's routed rows from now on."""
        return PlainTextResponse((await ask(request, "start")).message)

    @app.api_route("/stop_expert_distribution_record", methods=METHODS)
    async def stop_expert_distribution_record(request: Request) -> PlainTextResponse:
        """Stop counting; the counts stay for a dump."""
        return PlainTextResponse((await ask(request, "stop")).message)

    @app.api_route("/dump_expert_distribution_record", methods=METHODS)
    async def dump_expert_distribution_record(request: Request) -> JSONResponse:
        """The counts since the last start as JSON. SGLang writes a .pt file on the server instead; this body,
        saved by the caller (`curl ... > loads.json`), is a file that --init-expert-location loads.json reads
        back."""
        return JSONResponse((await ask(request, "dump")).state)
