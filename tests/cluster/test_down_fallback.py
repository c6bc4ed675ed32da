"""`down` when the supervisor itself was killed: the members (in their own sessions) are stopped by the
PIDs in the state file, so nothing is left behind."""

import signal
import time

import psutil

from tests.cluster.conftest import RunningGroup, pid_alive

MOONCAKE_ONLY = """
name: kvdown
roles:
  - {name: mooncake-master, kind: mooncake-master}
  - {name: mooncake-store, kind: mooncake-store, dependencies: [mooncake-master], args: {segment-size: 16mb}}
"""


def test_down_after_the_supervisor_was_killed(mooncake_env, tmp_path):
    group = RunningGroup(tmp_path, MOONCAKE_ONLY)
    try:
        group.start(timeout_s=120)
        status = group.status()
        members = [m["pid"] for r in status["roles"] for m in r["members"]]
        assert len(members) == 2 and all(members)
        # the master member runs Mooncake's metadata server and mooncake_master as children
        members += [c.pid for p in members for c in psutil.Process(p).children(recursive=True)]
        assert len(members) >= 4
        group.proc.send_signal(signal.SIGKILL)
        group.proc.wait(10)
        time.sleep(0.5)
        assert all(pid_alive(p) for p in members)              # orphans until someone stops them
        res = group.cli("status")
        assert res.returncode == 1 and "not answering" in res.stdout
        res = group.cli("down")
        assert res.returncode == 0 and "stopped by PID" in res.stdout, res.stdout + res.stderr
        deadline = time.monotonic() + 30
        while any(pid_alive(p) for p in members) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(pid_alive(p) for p in members)
        assert "is not up" in group.cli("down").stdout          # and a second down is a no-op
    finally:
        group.kill_everything()
