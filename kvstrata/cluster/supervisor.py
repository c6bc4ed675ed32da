"""`kvstrata cluster up`: the group as supervised local processes, in the foreground.

    start    roles in dependency order; a role starts once every member of its dependencies is ready
             (roles that do not depend on each other start together)
    watch    a member that exits unexpectedly is restarted after a backoff (1 s, doubling, at most 30 s),
             counted, and held while a dependency is not ready; a restarted server is re-admitted by the router
    upgrade  one member at a time: router drains it -> process replaced on the same port -> ready -> re-admitted;
             a store member: the new process starts beside the old one, the objects move to its segment
             (store_migration.py), then the old process stops
    stop     SIGTERM/Ctrl-C or `kvstrata cluster down`: roles in reverse order, each member by its PID

State (`state.json`) and the control socket live in the run directory; one log per member under logs/.
The supervisor's own threads: the main loop (watch), and one per control connection; `self.lock`
serialises every change to members.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

from kvstrata.cluster import router_admin
from kvstrata.cluster.control import ControlReply, ControlRequest, ControlServer, Progress
from kvstrata.cluster.member import BACKOFF_FIRST_S, BACKOFF_MAX_S, STABLE_S, Member, MemberError, child_env
from kvstrata.cluster.plan import KIND_PORTS, LocalNetwork, member_command, mooncake_addresses
from kvstrata.cluster.spec import SERVER_KINDS, GroupSpec, RoleSpec, SpecError, check_spec
from kvstrata.cluster.store_migration import segment_of
from kvstrata.process import stop_group
from kvstrata.storage.mooncake_config import free_port

WATCH_PERIOD_S = 0.25


class ClusterError(RuntimeError):
    """The group could not be started or an operation on it failed."""


class Supervisor:
    """Runs one group; `run()` blocks until the group is stopped."""

    def __init__(self, spec: GroupSpec, run_dir: Path, router_port: int = 30000):
        self.spec = spec
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.net = LocalNetwork(self._allocate_ports(router_port), str(self.run_dir))
        self.members: dict[str, list[Member]] = {
            role.name: [Member(role, member_command(spec, role, i, self.net),
                               self.run_dir / "logs" / f"{role.name}-{i}.log") for i in range(role.replicas)]
            for role in spec.start_order()}
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.stopped = threading.Event()
        self.started = threading.Event()     # every role was ready once: upgrades are accepted from then on
        self.changing = threading.Lock()     # one upgrade/restart at a time
        self.control: Optional[ControlServer] = None

    def _allocate_ports(self, router_port: int) -> dict[tuple[str, int], dict[str, int]]:
        ports = {}
        for role in self.spec.roles:
            for i in range(role.replicas):
                ports[(role.name, i)] = {name: router_port if role.kind == "router" else free_port()
                                         for name in KIND_PORTS[role.kind]}
        return ports

    # ------------------------------------------------------------------ paths
    @property
    def socket_path(self) -> str:
        """The control socket."""
        return str(self.run_dir / "control.sock")

    @property
    def state_path(self) -> Path:
        """The state file `status`/`down` fall back on when the supervisor is gone."""
        return self.run_dir / "state.json"

    def router(self) -> Optional[Member]:
        """The router member, if the group has one."""
        routers = self.spec.roles_of("router")
        return self.members[routers[0].name][0] if routers else None

    # ------------------------------------------------------------------ lifecycle
    def start(self, log: Progress = print) -> None:
        """Start the roles in waves: each wave is every role whose dependencies are all ready; ClusterError
        on failure."""
        self.control = ControlServer(self.socket_path, self.handle)
        pending = self.spec.start_order()
        try:
            while pending:
                names = {r.name for r in pending}
                wave = [r for r in pending if not names & set(r.dependencies)]
                with self.lock:
                    for role in wave:
                        log(f"starting {role.name} ({role.kind}, {role.replicas} member(s))")
                        for member in self.members[role.name]:
                            member.spawn()
                    self.write_state()
                for member in (m for role in wave for m in self.members[role.name]):
                    member.wait_ready()
                    log(f"  {member.name} ready (pid {member.pid}, ports {member.cmd.ports})")
                self.write_state()
                pending = [r for r in pending if r not in wave]
        except MemberError as e:
            raise ClusterError(str(e)) from None
        self.started.set()

    def run(self, log: Progress = print) -> None:
        """Watch the members until `stopping` is set, then stop the group."""
        try:
            while not self.stopping.wait(WATCH_PERIOD_S):
                self.watch(log)
        finally:
            self.stop(log)

    def stop(self, log: Progress = print) -> None:
        """Stop every member, roles in reverse start order; remove the socket and state file."""
        with self.lock:
            for role in reversed(self.spec.start_order()):
                for member in self.members[role.name]:
                    if member.proc is not None and member.state != "stopped":
                        log(f"stopping {member.name} (pid {member.proc.pid})")
                    member.stop()
            self.state_path.unlink(missing_ok=True)
        self.stopped.set()
        if self.control is not None:
            self.control.close()

    # ------------------------------------------------------------------ watch and restart
    def watch(self, log: Progress) -> None:
        """One pass: notice exits, restart members whose backoff is over and whose dependencies are ready."""
        now = time.monotonic()
        changed = False
        with self.lock:
            for members in self.members.values():
                for m in members:
                    changed |= self._watch_member(m, now, log)
            if changed:
                self.write_state()

    def _watch_member(self, m: Member, now: float, log: Progress) -> bool:
        if m.state in ("ready", "starting") and m.exited():
            m.restarts += 1
            m.state = "restarting"
            m.restart_at = now + m.backoff_s
            log(f"{m.name} exited with code {m.proc.returncode}; restart #{m.restarts} in {m.backoff_s:g} s")
            m.backoff_s = min(BACKOFF_MAX_S, m.backoff_s * 2)
            return True
        if m.state == "restarting" and now >= m.restart_at and self.dependencies_ready(m.role):
            m.spawn()
            return True
        if m.state == "starting" and m.healthy():
            m.mark_ready()
            log(f"{m.name} ready again (pid {m.pid})")
            self._readmit(m, log)
            return True
        if m.state == "ready" and m.backoff_s > BACKOFF_FIRST_S and now - m.ready_since > STABLE_S:
            m.backoff_s = BACKOFF_FIRST_S
        return False

    def dependencies_ready(self, role: RoleSpec) -> bool:
        """Whether every member of every dependency of `role` is ready."""
        return all(m.state == "ready" and m.pid is not None
                   for dep in role.dependencies for m in self.members[dep])

    def _readmit(self, m: Member, log: Progress) -> None:
        router = self.router()
        if m.role.kind in SERVER_KINDS and router is not None and router.state == "ready" and router is not m:
            log(f"  router: {router_admin.add_worker(router.url, m.url)}")

    # ------------------------------------------------------------------ control requests
    def handle(self, req: ControlRequest, progress: Progress) -> ControlReply:
        """Answer one control request (status, upgrade, restart, down)."""
        if req.op == "status":
            return ControlReply(done=True, data=self.status())
        if req.op == "down":
            self.stopping.set()
            self.stopped.wait(120)
            return ControlReply(done=True, message="group stopped")
        if self.stopping.is_set() or not self.started.is_set():
            return ControlReply(done=True, ok=False,
                                message="the group is " + ("stopping" if self.stopping.is_set() else "still starting"))
        role = self.spec.role(req.role or "")
        if not self.changing.acquire(blocking=False):
            return ControlReply(done=True, ok=False, message="another upgrade or restart is in progress")
        try:
            if req.op == "upgrade":
                self.upgrade(role, req.settings, progress)
                return ControlReply(done=True, message=f"{role.name} upgraded", data=self.status())
            self.restart_all(role, progress)
            return ControlReply(done=True, message=f"{role.name} restarted", data=self.status())
        finally:
            self.changing.release()

    def upgrade(self, role: RoleSpec, settings: dict[str, Any], progress: Progress) -> None:
        """In place, one member at a time: drain -> replace on the same port -> ready -> re-admit."""
        new_role = self._apply_settings(role, settings)
        if role.kind == "mooncake-store":
            for m in self.members[role.name]:
                with self.lock:
                    m.role, m.cmd = new_role, member_command(self.spec, new_role, m.cmd.index, self.net)
                self._replace_store(m, progress)
            return
        router = self.router()
        drains = role.kind in SERVER_KINDS and router is not None
        for m in self.members[role.name]:
            with self.lock:
                m.state = "upgrading"
                m.role, m.cmd = new_role, member_command(self.spec, new_role, m.cmd.index, self.net)
            if drains:
                progress(f"{m.name}: draining ({router_admin.remove_worker(router.url, m.url, drain=True)})")
            progress(f"{m.name}: stopping pid {m.pid}")
            m.stop()
            self._respawn(m)
            progress(f"{m.name}: started pid {m.pid} on {m.cmd.ports}; waiting for readiness")
            self._await_ready(m)
            if drains:
                progress(f"{m.name}: re-admitted ({router_admin.add_worker(router.url, m.url)})")
            with self.lock:
                self.write_state()
            progress(f"{m.name}: upgraded (pid {m.pid})")

    def _replace_store(self, m: Member, progress: Progress) -> None:
        """Surge and migrate: start the new store process beside the old one, move every object off the old
        segment onto the new one, then stop the old process; the L3 pages survive the upgrade."""
        ready_file = m.cmd.probe.path
        old_proc, source = m.proc, segment_of(ready_file)
        self._respawn(m)
        progress(f"{m.name}: new store pid {m.pid} started beside pid {old_proc.pid}; waiting for readiness")
        try:
            self._await_ready(m)
        except ClusterError:
            with self.lock:
                m.proc, m.state = old_proc, "ready"      # the old store goes on serving
            raise
        try:
            target = segment_of(ready_file)
            progress(f"{m.name}: moving objects from segment {source} to {target}")
            progress(f"{m.name}: {self._migrate(m, source, target)}")
        finally:
            progress(f"{m.name}: stopping the old store pid {old_proc.pid}")
            stop_group(old_proc.pid)
            old_proc.wait(10)
        with self.lock:
            self.write_state()
        progress(f"{m.name}: upgraded (pid {m.pid})")

    def _migrate(self, m: Member, source: str, target: str) -> str:
        """Run store_migration in its own process (a Mooncake client of the group); returns its counts."""
        master, metadata = mooncake_addresses(self.spec, self.net)
        admin = f"http://127.0.0.1:{self.net.port(self.spec.roles_of('mooncake-master')[0], 0, 'metrics')}"
        cmd = [sys.executable, "-m", "kvstrata.cluster.store_migration", "--master", master, "--metadata",
               metadata, "--admin-url", admin, "--source", source, "--target", target]
        with open(m.log_path, "ab") as log:
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, env=child_env(m.cmd.env), timeout=600)
        lines = done.stdout.decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else f"migration exited with code {done.returncode} (see {m.log_path})"

    def restart_all(self, role: RoleSpec, progress: Progress) -> None:
        """The naive way, for comparison: stop every member of the role at once, no drain, then start them."""
        members = self.members[role.name]
        with self.lock:
            for m in members:
                m.state = "upgrading"
        for m in members:
            progress(f"{m.name}: stopping pid {m.pid}")
            m.stop(grace_s=5)
        for m in members:
            self._respawn(m)
        for m in members:
            self._await_ready(m)
            progress(f"{m.name}: restarted (pid {m.pid})")
        with self.lock:
            self.write_state()

    def _respawn(self, m: Member) -> None:
        """Start a member's new process; it stays 'upgrading' (ignored by watch) until ready."""
        with self.lock:
            if self.stopping.is_set():       # the group went down meanwhile: start nothing new
                raise ClusterError(f"{m.name}: not restarted, the group is stopping")
            m.spawn()
            m.state = "upgrading"
            self.write_state()

    def _await_ready(self, m: Member) -> None:
        """Wait for an upgraded member; if it fails, hand it to watch (restart with backoff) and raise."""
        try:
            m.wait_ready()
        except MemberError as e:
            with self.lock:
                m.stop(grace_s=5)
                m.state, m.restart_at = "restarting", time.monotonic() + m.backoff_s
            raise ClusterError(str(e)) from None

    def _apply_settings(self, role: RoleSpec, settings: dict[str, Any]) -> RoleSpec:
        """The role with `--set` applied (args by flag name, or env.NAME), checked like a spec."""
        args, env = dict(role.args), dict(role.env)
        for key, value in settings.items():
            if key == "image":
                raise ClusterError("--set image: images are for Kubernetes (`kubectl patch`, see the README); "
                                   "a local member runs the code installed here")
            if key.startswith("env."):
                env[key[4:]] = str(value)
            else:
                args[key.lstrip("-")] = value
        new_role = dataclasses.replace(role, args=args, env=env)
        new_spec = dataclasses.replace(self.spec, roles=tuple(new_role if r is role else r for r in self.spec.roles))
        try:
            check_spec(new_spec)
        except SpecError as e:
            raise ClusterError(f"--set: {e}") from None
        self.spec = new_spec
        return new_role

    # ------------------------------------------------------------------ state
    def status(self) -> dict:
        """Roles and members: PIDs, ports, state, health, restarts."""
        with self.lock:
            router = self.router()
            return {"name": self.spec.name, "supervisor_pid": os.getpid(), "run_dir": str(self.run_dir),
                    "router_url": router.url if router else None,
                    "roles": [{"name": r.name, "kind": r.kind, "members": [m.status() for m in self.members[r.name]]}
                              for r in self.spec.start_order()]}

    def write_state(self) -> None:
        """Write PIDs and ports atomically, for `status`/`down` without the socket."""
        state = {"name": self.spec.name, "supervisor_pid": os.getpid(), "socket": self.socket_path,
                 "members": [{"name": m.name, "role": m.role.name, "pid": m.pid, "ports": m.cmd.ports,
                              "state": m.state, "restarts": m.restarts}
                             for r in self.spec.start_order() for m in self.members[r.name]]}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(self.state_path)
