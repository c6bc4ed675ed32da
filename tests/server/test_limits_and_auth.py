"""Request size limits, who may call what, and leftovers of killed servers.

- a body over --max-request-body-bytes gets 413 at once, and /health and other requests are not delayed;
- a prompt whose length already proves it too long is rejected before tokenizing;
- /health_generate needs the API key, only /health and /metrics are open, 'Bearer' is case-insensitive;
- aborting is an admin action (--admin-api-key; loopback only without it) and reports true counts;
- stale IPC directories of killed servers are removed at start.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import tempfile
import threading
import time

import pytest
import requests

from kvstrata.server.launch import IPC_PREFIX, remove_stale_ipc_dirs
from tests.server.conftest import API_KEY, launch_server, pid_alive, stop_server
from tests.server.helpers import HealthProbe, parse_sse

ADMIN_KEY = "admin-secret"
GREEDY = {"text": "The quick brown fox", "sampling_params": {"temperature": 0, "max_new_tokens": 6}}


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture(scope="module")
def admin_server(tmp_path_factory):
    """A server with an API key and an admin key; started after a stale IPC directory was planted."""
    stale = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{dead_pid()}-")
    handle = launch_server(tmp_path_factory.mktemp("admin"), "--admin-api-key", ADMIN_KEY, api_key=API_KEY)
    handle.planted_stale_dir = stale
    try:
        yield handle
    finally:
        stop_server(handle)





def post_raw(server, body, path: str = "/generate") -> requests.Response:
    return requests.post(server.url + path, data=body, timeout=120,
                         headers={**server.headers, "Content-Type": "application/json"})


@pytest.mark.parametrize("chunked", [False, True])
def test_50mb_body_is_413_while_health_and_others_go_on(server, chunked):
    expected = server.post("/generate", json=GREEDY).json()["output_ids"]
    big = b'{"text": "' + b"a" * (50 << 20) + b'"}'
    body = (big[i:i + (1 << 20)] for i in range(0, len(big), 1 << 20)) if chunked else big
    result: dict = {}

    def upload() -> None:
        result["response"] = post_raw(server, body)

    with HealthProbe(server.url) as probe:
        uploader = threading.Thread(target=upload)
        uploader.start()
        small = server.post("/generate", json=GREEDY)
        uploader.join(120)
    r = result["response"]
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"], r.text
    assert small.status_code == 200 and small.json()["output_ids"] == expected
    assert not probe.failures and probe.worst < 1.0, (probe.worst, probe.failures)


def test_prompt_too_long_by_its_length_is_rejected_before_tokenizing(server):
    body = ('{"text": "' + "hello world " * 400_000 + '"}').encode()     # 4.8 MB, under the body cap
    with HealthProbe(server.url) as probe:
        started = time.monotonic()
        r = post_raw(server, body)
        elapsed = time.monotonic() - started
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    assert elapsed < 5.0 and not probe.failures and probe.worst < 1.0
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * 1_000_000}]}
    r = server.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text


def test_health_generate_needs_the_key_and_only_exact_paths_are_open(server):
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    assert requests.get(server.url + "/metrics", timeout=30).status_code == 200
    assert requests.get(server.url + "/health_generate", timeout=30).status_code == 401
    assert requests.get(server.url + "/healthz", timeout=30).status_code == 401
    assert requests.get(server.url + "/health/../server_info", timeout=30).status_code in (401, 404)
    assert server.get("/health_generate").status_code == 200


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer", "bEaReR"])
def test_bearer_scheme_is_case_insensitive(server, scheme):
    r = requests.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"}, timeout=30)
    assert r.status_code == 200, r.text
    r = requests.get(server.url + "/v1/models", headers={"Authorization": f"{scheme} wrong"}, timeout=30)
    assert r.status_code == 401


def test_abort_needs_the_admin_key_not_the_api_key(admin_server):
    url = admin_server.url + "/abort_request"
    body = {"abort_all": True}
    assert requests.post(url, json=body, timeout=30).status_code == 401
    assert requests.post(url, json=body, headers=admin_server.headers, timeout=30).status_code == 401
    r = requests.post(url, json=body, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"success": True, "aborted": 0}
    r = requests.post(url, json={"rid": "never-existed"}, headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                      timeout=30)
    assert r.status_code == 200 and r.json()["aborted"] == 0


def test_admin_abort_of_a_running_stream_counts_it_and_ends_it(admin_server):
    body = {"text": "count", "rid": "victim-1", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    r = requests.post(admin_server.url + "/generate", json=body, headers=admin_server.headers, stream=True,
                      timeout=120)
    assert r.status_code == 200
    lines = r.iter_lines(decode_unicode=True)
    next(line for line in lines if line)            # the stream is running
    aborted = requests.post(admin_server.url + "/abort_request", json={"rid": "victim-1"}, timeout=30,
                            headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert aborted.json()["aborted"] == 1
    events = parse_sse(lines)
    assert events[-1] == "[DONE]" and events[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert admin_server.wait_idle()["integrity_ok"]


def test_without_an_admin_key_only_loopback_may_abort():
    from starlette.requests import Request

    from kvstrata.serving.errors import ApiError
    from kvstrata.web.auth import require_admin

    def request_from(host: str) -> Request:
        return Request({"type": "http", "method": "POST", "path": "/abort_request", "headers": [],
                        "client": (host, 5000)})

    for host in ("127.0.0.1", "::1", "127.0.0.2"):
        require_admin(request_from(host), None)
    for host in ("10.0.0.7", "192.168.1.2", "2001:db8::1", "not-an-ip"):
        with pytest.raises(ApiError) as e:
            require_admin(request_from(host), None)
        assert e.value.status == 403


@pytest.mark.parametrize("headers, allowed", [
    ({}, True),                                                           # curl, SDKs: no browser headers
    ({"origin": "http://127.0.0.1:30000"}, True),                         # the server's own page
    ({"sec-fetch-site": "same-origin", "origin": "http://127.0.0.1:30000"}, True),
    ({"sec-fetch-site": "none"}, True),                                   # typed into the address bar
    ({"origin": "https://evil.example"}, False),                          # a form or fetch on another site
    ({"origin": "null"}, False),                                          # a sandboxed frame or a file
    ({"origin": "http://127.0.0.1:8080"}, False),                         # another local port is another origin
    ({"sec-fetch-site": "cross-site"}, False),
    ({"sec-fetch-site": "same-site"}, False),
], ids=["no-browser", "own-page", "own-page-fetch-meta", "address-bar", "other-site", "null-origin",
        "other-port", "cross-site", "same-site"])
def test_without_an_admin_key_no_other_site_may_abort_through_a_local_browser(headers, allowed):
    from starlette.requests import Request

    from kvstrata.serving.errors import ApiError
    from kvstrata.web.auth import require_admin

    raw = [(b"host", b"127.0.0.1:30000")] + [(k.encode(), v.encode()) for k, v in headers.items()]
    request = Request({"type": "http", "method": "POST", "path": "/abort_request", "headers": raw,
                       "client": ("127.0.0.1", 5000)})
    if allowed:
        require_admin(request, None)
    else:
        with pytest.raises(ApiError) as e:
            require_admin(request, None)
        assert e.value.status == 403 and "another site" in e.value.message
    require_admin(Request({**request.scope, "headers": raw + [(b"authorization", b"Bearer k")]}), "k")


def test_stale_ipc_dirs_are_removed_at_start(admin_server):
    assert not os.path.exists(admin_server.planted_stale_dir)
    live = glob.glob(os.path.join(tempfile.gettempdir(), f"{IPC_PREFIX}{admin_server.proc.pid}-*"))
    assert len(live) == 1          # its own, named after its pid, is kept


def test_ipc_dir_of_a_killed_server_is_removed_by_the_next_start(tmp_path):
    handle = launch_server(tmp_path)
    try:
        pattern = os.path.join(tempfile.gettempdir(), f"{IPC_PREFIX}{handle.proc.pid}-*")
        assert len(glob.glob(pattern)) == 1
        scheduler_pid = handle.server_info()["scheduler_pid"]
        os.kill(handle.proc.pid, signal.SIGKILL)
        handle.proc.wait(30)
        deadline = time.monotonic() + 30
        while pid_alive(scheduler_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert glob.glob(pattern), "kill -9 left no directory behind: nothing to test"
        remove_stale_ipc_dirs()        # what every server start runs first
        assert not glob.glob(pattern)
    finally:
        stop_server(handle)
