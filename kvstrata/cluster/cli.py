"""`kvstrata cluster spec|render|up|status|down|logs|upgrade|restart`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional

import psutil
import yaml

from kvstrata.cluster import control
from kvstrata.cluster.control import ControlRequest
from kvstrata.cluster.spec import DEFAULT_SPEC_YAML, GroupSpec, SpecError, load_spec
from kvstrata.platform import cache_dir
from kvstrata.process import stop_group


def run_dir_for(spec: GroupSpec, override: Optional[str] = None) -> Path:
    """Where `up` keeps the state, socket and logs of a group: one directory per spec name."""
    if override:
        return Path(override)
    return cache_dir() / "cluster" / spec.name


def build_parser() -> argparse.ArgumentParser:
    """The `kvstrata cluster` parser."""
    p = argparse.ArgumentParser(prog="kvstrata cluster", description="Role-based deployment: run a role group "
                                "locally as supervised processes, or render it as a Kubernetes RoleBasedGroup.")
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("spec", help="print the default spec (a starting point for your own)")
    r = sub.add_parser("render", help="print Kubernetes manifests (RoleBasedGroup + Services)")
    r.add_argument("spec", nargs="?")
    r.add_argument("--image", help="container image of every role (overrides the spec)")
    r.add_argument("-o", "--output-dir", help="write one file per manifest here instead of stdout")
    for name, text in (("up", "run the group here in the foreground"), ("status", "roles, members, health"),
                       ("down", "stop a running group"), ("logs", "print a role's member logs"),
                       ("upgrade", "in-place upgrade of one role, one member at a time"),
                       ("restart", "naive restart of one role: every member at once, no drain")):
        c = sub.add_parser(name, help=text)
        if name == "logs":
            c.add_argument("role")
            c.add_argument("-n", "--lines", type=int, default=50)
        c.add_argument("spec", nargs="?")
        c.add_argument("--run-dir", help="state, socket and logs (default: $KVSTRATA_CACHE_DIR/cluster/NAME)")
        if name == "up":
            c.add_argument("--router-port", type=int, default=30000)
        if name in ("upgrade", "restart"):
            c.add_argument("--role", required=True)
        if name == "upgrade":
            c.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                           help="a role argument (flag name) or env.NAME; repeatable")
    return p


def parse_settings(items: list[str]) -> dict[str, Any]:
    """`["page-size=32", "enable-x=true"]` -> `{"page-size": 32, "enable-x": True}` (values read as YAML)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecError(f"--set {item!r}: expected KEY=VALUE")
        out[key.strip()] = yaml.safe_load(value) if value else ""
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Entry point of `kvstrata cluster`."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "spec":
            print(DEFAULT_SPEC_YAML, end="")
            return 0
        spec = load_spec(args.spec)
        if args.command == "render":
            return cmd_render(spec, args)
        return COMMANDS[args.command](spec, run_dir_for(spec, args.run_dir), args)
    except SpecError as e:
        print(f"kvstrata cluster: invalid spec: {e}", file=sys.stderr)
        return 2


def cmd_render(spec: GroupSpec, args: argparse.Namespace) -> int:
    """Print or write the manifests."""
    from kvstrata.cluster.render import render, to_yaml, write_manifests

    docs = render(spec, args.image)
    if args.output_dir:
        for path in write_manifests(docs, args.output_dir):
            print(path)
    else:
        print(to_yaml(docs), end="")
    return 0


def cmd_up(spec: GroupSpec, run_dir: Path, args: argparse.Namespace) -> int:
    """Run the group until SIGTERM/Ctrl-C or `down`."""
    from kvstrata.cluster.supervisor import ClusterError, Supervisor

    if _supervisor_answers(run_dir):
        print(f"kvstrata cluster: group {spec.name!r} is already up (run dir {run_dir}); `down` it first",
              file=sys.stderr)
        return 1
    sup = Supervisor(spec, run_dir, args.router_port)
    started = {"done": False}

    def on_signal(signum: int, frame: Any) -> None:
        sup.stopping.set()
        if not started["done"]:
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        sup.start(log=_log)
    except (ClusterError, KeyboardInterrupt) as e:
        _log(f"start failed: {e}" if isinstance(e, ClusterError) else "interrupted")
        sup.stop(log=_log)
        return 1
    started["done"] = True
    router = sup.router()
    _log(f"group {spec.name!r} is up" + (f"; router at {router.url}" if router else "") +
         f"; logs in {run_dir / 'logs'}")
    sup.run(log=_log)
    _log("group stopped")
    return 0


def cmd_status(spec: GroupSpec, run_dir: Path, args: argparse.Namespace) -> int:
    """Print the live status (or the last recorded state if the supervisor is gone)."""
    try:
        reply = control.call(str(run_dir / "control.sock"), ControlRequest("status"), timeout_s=30)
    except OSError:
        state = _read_state(run_dir)
        if state is None:
            print(f"group {spec.name!r} is not up (no state in {run_dir})")
            return 1
        print(f"group {spec.name!r}: supervisor pid {state['supervisor_pid']} not answering; last state:")
        print(json.dumps(state, indent=2))
        return 1
    data = reply.data
    print(f"group {data['name']}  supervisor pid {data['supervisor_pid']}  router {data['router_url']}")
    print(f"{'ROLE':<18}{'MEMBER':<20}{'PID':>8}  {'PORTS':<42}{'STATE':<12}{'HEALTH':<9}RESTARTS")
    for role in data["roles"]:
        for m in role["members"]:
            ports = ",".join(f"{k}={v}" for k, v in m["ports"].items()) or "-"
            print(f"{role['name']:<18}{m['name']:<20}{m['pid'] or '-':>8}  {ports:<42}{m['state']:<12}"
                  f"{'ok' if m['healthy'] else 'no':<9}{m['restarts']}")
    return 0


def cmd_down(spec: GroupSpec, run_dir: Path, args: argparse.Namespace) -> int:
    """Stop the group: through its supervisor, or by the PIDs in its state file if the supervisor is gone."""
    pid = (_read_state(run_dir) or {}).get("supervisor_pid")
    try:
        reply = control.call(str(run_dir / "control.sock"), ControlRequest("down"), timeout_s=180)
        print(reply.message)
    except OSError:
        state = _read_state(run_dir)
        if state is None:
            print(f"group {spec.name!r} is not up")
            return 0
        for member in reversed(state["members"]):
            if member.get("pid"):
                stop_group(member["pid"])
        if _running(state["supervisor_pid"]):
            os.kill(state["supervisor_pid"], signal.SIGKILL)
        (run_dir / "state.json").unlink(missing_ok=True)
        print("group stopped by PID (the supervisor was not answering)")
    deadline = time.monotonic() + 30
    while pid and _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return 0


def cmd_logs(spec: GroupSpec, run_dir: Path, args: argparse.Namespace) -> int:
    """Print the last lines of each member log of a role."""
    role = spec.role(args.role)
    for i in range(role.replicas):
        path = run_dir / "logs" / f"{role.name}-{i}.log"
        print(f"==> {path} <==")
        try:
            print("\n".join(path.read_text(errors="replace").splitlines()[-args.lines:]))
        except OSError:
            print("(no log yet)")
    return 0


def cmd_change(spec: GroupSpec, run_dir: Path, args: argparse.Namespace) -> int:
    """upgrade / restart: ask the running supervisor, print its progress."""
    spec.role(args.role)
    req = ControlRequest(args.command, role=args.role,
                         settings=parse_settings(getattr(args, "set", [])))
    try:
        reply = control.call(str(run_dir / "control.sock"), req, progress=_log)
    except OSError as e:
        print(f"kvstrata cluster: group {spec.name!r} is not up ({e}); start it with `kvstrata cluster up`",
              file=sys.stderr)
        return 1
    _log(reply.message)
    return 0 if reply.ok else 1


def _supervisor_answers(run_dir: Path) -> bool:
    try:
        control.call(str(run_dir / "control.sock"), ControlRequest("status"), timeout_s=10)
        return True
    except OSError:
        return False


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting for its parent counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _read_state(run_dir: Path) -> Optional[dict]:
    try:
        return json.loads((run_dir / "state.json").read_text())
    except (OSError, ValueError):
        return None


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


COMMANDS = {"up": cmd_up, "status": cmd_status, "down": cmd_down, "logs": cmd_logs,
            "upgrade": cmd_change, "restart": cmd_change}
