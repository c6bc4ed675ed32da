"""Supervisor rules that need no running group."""

import subprocess

from kvstrata.cluster.spec import load_spec
from kvstrata.cluster.supervisor import Supervisor


def test_a_restart_waits_for_the_dependencies(tmp_path):
    """The rule watch() applies before restarting a member: every member of every dependency ready and running."""
    sup = Supervisor(load_spec(), tmp_path)     # not started: dependency members get stand-in processes here
    worker = load_spec().role("worker")
    deps = [m for name in ("mooncake-master", "mooncake-store") for m in sup.members[name]]
    assert not sup.dependencies_ready(worker)
    try:
        for m in deps:
            m.proc, m.state = subprocess.Popen(["sleep", "60"]), "ready"
        assert sup.dependencies_ready(worker)
        deps[0].proc.kill()
        deps[0].proc.wait()
        assert not sup.dependencies_ready(worker)              # the master is down: hold the worker
        assert sup.dependencies_ready(load_spec().role("mooncake-master"))
    finally:
        for m in deps:
            if m.proc is not None:
                m.proc.kill()
                m.proc.wait()
