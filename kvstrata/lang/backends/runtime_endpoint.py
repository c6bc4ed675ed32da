"""RuntimeEndpoint: a lang backend that speaks the SGLang-native HTTP API of a running server.

    backend = RuntimeEndpoint("http://127.0.0.1:30000", api_key=None)

Calls: `GET /get_model_info` (once), `POST /generate` (text prompts; `stream` for streaming; input_ids
batches with `max_new_tokens: 0` and `return_logprob` to score `select` choices), `/flush_cache`,
`/server_info`. Every call has a timeout; HTTP errors raise BackendError with the server's message.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Optional, Union

import requests
from requests.adapters import HTTPAdapter

from kvstrata.lang.backends.base import Backend, BackendError, GenOutput, LogprobEntry
from kvstrata.lang.sampling import SamplingArgs

DEFAULT_TIMEOUT_S = 600.0          # a whole non-streamed generation, or the gap between two stream events
CONNECT_TIMEOUT_S = 10.0
_POOL_SIZE = 128                   # run_batch threads share one session; keep their connections alive


class RuntimeEndpoint(Backend):
    """Backend over a kvstrata (or SGLang) server's native API."""

    def __init__(self, base_url: str, api_key: Optional[str] = None, verify: Union[bool, str, None] = None,
                 chat_template: Optional[str] = None, tokenizer_path: Optional[str] = None,
                 timeout: float = DEFAULT_TIMEOUT_S):
        super().__init__(chat_template)
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = (CONNECT_TIMEOUT_S, timeout)
        self._tokenizer_path = tokenizer_path
        self._session = requests.Session()
        self._session.mount("http://", HTTPAdapter(pool_connections=4, pool_maxsize=_POOL_SIZE))
        self._session.mount("https://", HTTPAdapter(pool_connections=4, pool_maxsize=_POOL_SIZE))
        if verify is not None:
            self._session.verify = verify
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"
        self.model_info: dict[str, Any] = self._call("GET", "/get_model_info").json()

    # ------------------------------------------------------------------ generation
    def generate(self, prompt: str, args: SamplingArgs) -> GenOutput:
        """POST /generate and wait for the whole answer."""
        body = {"text": prompt, "sampling_params": args.sampling_params(), **args.logprob_args()}
        obj = self._call("POST", "/generate", body).json()
        return GenOutput(obj["text"], obj["meta_info"])

    def generate_stream(self, prompt: str, args: SamplingArgs) -> Iterator[GenOutput]:
        """POST /generate with `stream: true`; yields cumulative results until `data: [DONE]`."""
        body = {"text": prompt, "sampling_params": args.sampling_params(), **args.logprob_args(), "stream": True}
        resp = self._call("POST", "/generate", body, stream=True)
        with resp:
            try:
                for line in resp.iter_lines(decode_unicode=True):
                    if not line or not line.startswith("data:"):
                        continue
                    payload = line[len("data:"):].strip()
                    if payload == "[DONE]":
                        return
                    event = json.loads(payload)
                    if "error" in event:
                        raise BackendError(f"/generate failed while streaming: {_message(event)}")
                    yield GenOutput(event["text"], event["meta_info"])
            except requests.RequestException as e:
                raise BackendError(f"the stream from {self.base_url}/generate broke: {e}") from e
        raise BackendError(f"the stream from {self.base_url}/generate ended without [DONE]")

    def prompt_logprobs(self, input_ids: list[list[int]], logprob_start_len: int) -> list[list[LogprobEntry]]:
        """One batch /generate with `max_new_tokens: 0` returning each prompt's input_token_logprobs."""
        body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True, "logprob_start_len": logprob_start_len}
        objs = self._call("POST", "/generate", body).json()
        return [o["meta_info"]["input_token_logprobs"] for o in objs]

    def cache_prefix(self, prompt: str) -> dict[str, Any]:
        """POST /generate with `max_new_tokens: 0`: the server prefills and keeps the prefix in its cache."""
        body = {"text": prompt, "sampling_params": {"max_new_tokens": 0}}
        return self._call("POST", "/generate", body).json()["meta_info"]

    # ------------------------------------------------------------------ administration
    def flush_cache(self) -> None:
        """POST /flush_cache (raises BackendError when the server refuses, e.g. while requests run)."""
        self._call("POST", "/flush_cache")

    def get_server_info(self) -> dict[str, Any]:
        """GET /server_info."""
        return self._call("GET", "/server_info").json()

    def get_model_info(self) -> dict[str, Any]:
        """What GET /get_model_info answered when the backend was created."""
        return dict(self.model_info)

    def close(self) -> None:
        """Close the HTTP connections."""
        self._session.close()

    def _load_tokenizer(self) -> Any:
        from kvstrata.model.tokenizer import TokenizerLoadError, load_tokenizer

        path = self._tokenizer_path or self.model_info.get("tokenizer_path") or self.model_info.get("model_path")
        if not path:
            raise BackendError("the server's /get_model_info names no tokenizer_path; pass tokenizer_path=...")
        try:
            return load_tokenizer(path)
        except TokenizerLoadError as e:
            raise BackendError(f"chat templates and select need the server's tokenizer locally: {e} "
                               "(pass tokenizer_path=... to RuntimeEndpoint)") from e

    def _call(self, method: str, path: str, body: Optional[dict] = None, stream: bool = False) -> requests.Response:
        url = self.base_url + path
        try:
            resp = self._session.request(method, url, json=body, timeout=self.timeout, stream=stream)
        except requests.Timeout as e:
            raise BackendError(f"{method} {url} timed out ({e})") from e
        except requests.RequestException as e:
            raise BackendError(f"cannot reach the server at {self.base_url}: {e}") from e
        if resp.status_code >= 400:
            try:
                detail = _message(resp.json())
            except ValueError:
                detail = resp.text[:500]
            resp.close()
            raise BackendError(f"{method} {path} failed with HTTP {resp.status_code}: {detail}")
        return resp


def _message(obj: Any) -> str:
    """The error message of an `{"error": {...}}` body (or the body itself)."""
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        return str(obj["error"].get("message", obj["error"]))
    if isinstance(obj, dict) and "error" in obj:
        return str(obj["error"])
    return str(obj)
