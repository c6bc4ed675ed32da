"""The `kvstrata` command: `kvstrata serve [server flags]`, `kvstrata bench <name> [flags]`."""

from __future__ import annotations

import sys

USAGE = """usage: kvstrata <command> [flags]

commands:
  serve         start the HTTP server (same flags as python -m kvstrata.launch_server; --help lists them)
  router        route requests across workers (same flags as python -m kvstrata.router; --help lists them)
  bench NAME    run a benchmark: engine (prefill/decode speed vs transformers), multiturn (multi-turn
                cache benchmark against a server), compare (L1 vs L1+L2 vs L1+L2+L3), grammar
                (structured-output overhead), grammar-steps (the mask fill and apply per step), pd (prefill/decode disaggregation vs co-located),
                upgrade (in-place upgrade of a local role group under load), restart (a server restart
                with and without the L2 snapshot), dashboard, router, tp-collectives (all-reduce and
                all-gather between TP ranks: gloo vs shared memory); `kvstrata bench NAME --help`
  cluster CMD   role-based deployment: spec, render (Kubernetes RoleBasedGroup), up, status, down, logs,
                upgrade; `kvstrata cluster --help` for details
"""


def main(argv: list[str] | None = None) -> int:
    """Dispatch to a subcommand."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from kvstrata.server.launch import run_and_exit

        run_and_exit(rest)   # exits the process (skipping slow interpreter teardown)
    if command == "router":
        from kvstrata.router.launch import main as router_main

        return router_main(rest)
    if command == "bench":
        from kvstrata.bench import main as bench_main

        return bench_main(rest) or 0
    if command == "cluster":
        from kvstrata.cluster.cli import main as cluster_main

        return cluster_main(rest)
    print(f"kvstrata: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
