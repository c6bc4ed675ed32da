"""`kvstrata router` / `python -m kvstrata.router`: run the router until stopped (SIGINT/SIGTERM)."""

from __future__ import annotations

import argparse
import logging
from typing import Optional

from kvstrata.args import ConfigError
from kvstrata.router.args import RouterArgs


def main(argv: Optional[list[str]] = None) -> int:
    """Parse the flags and serve; returns the exit code."""
    import uvicorn

    from kvstrata.router.app import create_app

    parser = argparse.ArgumentParser(prog="kvstrata router",
                                     description="Route requests across kvstrata workers (SGLang router flags).")
    RouterArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    try:
        args = RouterArgs.from_cli_args(ns)
    except ConfigError as e:
        parser.error(str(e))
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    print(f"kvstrata router starting at {args.url} (policy {args.policy})", flush=True)
    uvicorn.run(create_app(args), host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                timeout_keep_alive=30, timeout_graceful_shutdown=5)
    return 0
