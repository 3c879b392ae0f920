"""Reward from an HTTP service: JSON over POST, standard library only.

Request: ``POST <url>`` with body ``{"prompts": [...], "completions": [...]}`` (``Content-Type:
application/json``). Answer: HTTP 200 with ``{"scores": [...]}`` or a plain JSON list, one output per response,
each in any form ``lmppo.rewards.placement`` accepts (a number, per-token numbers, [start, end, value] spans).

``timeout`` is a total deadline per request (connecting, sending and the whole answer: a server that trickles its
answer byte by byte cannot hold a run beyond it). Timeouts, refused connections, answers cut off before their
announced length, HTTP 429 and 5xx are retried ``retries`` times with exponential backoff; other
failures (4xx, an answer that is not JSON or has the wrong shape) are not, since asking again gives the same.
Credentials written in the URL (``https://user:pass@host/...``) are sent as HTTP basic auth and never printed.
"""

from __future__ import annotations

import base64
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from lmppo.config import RewardSourceConfig
from lmppo.errors import RewardError
from lmppo.rewards.sources import RewardSource, SourceContext, mask_url, register_reward_source


class _Retryable(Exception):
    pass


@register_reward_source("http")
class HttpSource(RewardSource):
    backoff: float = 0.5
    """Seconds before the first retry; doubled after each failed attempt, at most `max_backoff`."""
    max_backoff: float = 8.0

    def __init__(self, cfg: RewardSourceConfig, ctx: SourceContext):
        super().__init__(cfg, ctx)
        parts = urllib.parse.urlsplit(cfg.path)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise RewardError(f"reward source `{self.name}`: URL {mask_url(cfg.path)!r} must start with "
                              "http:// or https:// and name a host")
        self.shown_url = mask_url(cfg.path)
        self.headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            self.headers["Authorization"] = f"Basic {token}"
            netloc = parts.hostname + (f":{parts.port}" if parts.port else "")
            if ":" in parts.hostname:  # IPv6 literal
                netloc = f"[{parts.hostname}]" + (f":{parts.port}" if parts.port else "")
            self.url = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
        else:
            self.url = cfg.path
        self.timeout = float(cfg.timeout)
        self.retries = int(cfg.retries)

    def __call__(self, prompts: list[str], completions: list[str]) -> list:
        body = json.dumps({"prompts": list(prompts), "completions": list(completions)}).encode("utf-8")
        attempts = self.retries + 1
        delay = self.backoff
        last = ""
        for attempt in range(attempts):
            try:
                return self._post(body)
            except _Retryable as err:
                last = str(err)
                if attempt + 1 < attempts:
                    time.sleep(delay)
                    delay = min(delay * 2, self.max_backoff)
        tries = f" (after {attempts} attempts)" if attempts > 1 else ""
        raise RewardError(f"HTTP reward {self.shown_url}: {last}{tries}")

    def _post(self, body: bytes) -> list:
        """One request, answered in full within `timeout` seconds in total (connecting, sending, and every byte
        of the answer: a server that trickles its answer cannot hold the run beyond it)."""
        box: dict = {}

        def attempt() -> None:
            try:
                box["answer"] = self._post_once(body)
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = err

        worker = threading.Thread(target=attempt, name="lmppo-http-reward", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():  # left behind: its socket timeout ends it; a daemon thread never blocks the exit
            raise _Retryable(self._timed_out())
        if "error" in box:
            raise box["error"]
        return box["answer"]

    def _timed_out(self) -> str:
        """One message whichever clock ran out first: the total deadline, or the socket's own timeout."""
        return f"no complete answer within {self.timeout:g} s (timeout: a total deadline per request)"

    def _post_once(self, body: bytes) -> list:
        request = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                status = response.status
                try:
                    raw = response.read()
                except http.client.IncompleteRead as err:
                    expected = f" of {len(err.partial) + err.expected}" if err.expected is not None else ""
                    raise _Retryable(f"the answer was cut off after {len(err.partial)}{expected} bytes") from None
        except urllib.error.HTTPError as err:
            text = _body_text(err.read() if err.fp else b"")
            msg = f"answered HTTP {err.code}: {text!r}"
            if err.code == 429 or err.code >= 500:
                raise _Retryable(msg) from None
            raise RewardError(f"HTTP reward {self.shown_url}: {msg}") from None
        except urllib.error.URLError as err:
            reason = err.reason
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise _Retryable(self._timed_out()) from None
            if isinstance(reason, ConnectionRefusedError):
                raise _Retryable("connection refused (is the server running, on that port?)") from None
            raise _Retryable(f"cannot connect: {reason}") from None
        except (socket.timeout, TimeoutError):
            raise _Retryable(self._timed_out()) from None
        except ConnectionError as err:
            raise _Retryable(f"connection failed: {type(err).__name__}: {err}") from None
        except http.client.HTTPException as err:  # a malformed or cut-off status line or headers
            raise _Retryable(f"the answer was cut off or malformed ({type(err).__name__}: {str(err)[:200]})") from None
        except OSError as err:
            raise _Retryable(f"connection failed: {err.strerror or err}") from None
        if status != 200:
            raise RewardError(f"HTTP reward {self.shown_url}: answered HTTP {status} (expected 200): "
                              f"{_body_text(raw)!r}")
        try:
            answer: Any = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise RewardError(f"HTTP reward {self.shown_url}: the answer is not JSON: {_body_text(raw)!r}") from None
        if isinstance(answer, dict):
            if "scores" not in answer:
                raise RewardError(f"HTTP reward {self.shown_url}: the answer has keys {sorted(answer)[:10]}; "
                                  'expected {"scores": [...]} or a JSON list')
            answer = answer["scores"]
        if not isinstance(answer, list):
            raise RewardError(f"HTTP reward {self.shown_url}: `scores` is a {type(answer).__name__} "
                              f"({_body_text(raw)!r}); expected a list with one output per completion")
        return answer


def _body_text(raw: bytes, n: int = 200) -> str:
    return raw[:n * 4].decode("utf-8", errors="replace")[:n]
