"""Reward from an HTTP service: JSON over POST, standard library only.

Design notes: docs/design.md, `lmppo.rewards.http`."""

from __future__ import annotations

import base64
import datetime
import email.utils
import http.client
import json
import math
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from email.message import Message

from lmppo.config import RewardSourceConfig, http_headers
from lmppo.errors import ConfigError, RewardError
from lmppo.redact import MASK, redact_text
from lmppo.rewards.http_url import check_http_url
from lmppo.rewards.sources import RewardSource, SourceContext, mask_url, register_reward_source


class _Retryable(Exception):
    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after
        """Seconds the server asked to wait (`Retry-After`), None when it did not say."""


_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
"""How a kept-alive connection the server has closed in the meantime fails."""


@register_reward_source("http")
class HttpSource(RewardSource):
    backoff: float = 0.5
    """Seconds before the first retry; doubled after each failed attempt, at most `max_backoff`."""
    max_backoff: float = 8.0
    max_retry_after: float = 120.0
    """Longest `Retry-After` wait honoured; a server asking for more ends the run with a message."""

    def __init__(self, cfg: RewardSourceConfig, ctx: SourceContext):
        super().__init__(cfg, ctx)
        try:  # checked before training too (`check_reward_urls`); here for sources built another way
            parts = check_http_url(cfg.path, "path")
        except ConfigError as err:
            raise RewardError(f"reward source `{self.name}`: URL {mask_url(cfg.path)!r} {err.allowed}") from None
        self.shown_url = mask_url(cfg.path)
        extra, self._secrets = http_headers(cfg, f"reward source `{self.name}`")
        self.headers = {"Content-Type": "application/json", "Accept": "application/json", **extra}
        if parts.username is not None:
            user = urllib.parse.unquote(parts.username)
            password = urllib.parse.unquote(parts.password or "")
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            self.headers["Authorization"] = f"Basic {token}"
            self._secrets += [token, password]
        self._secrets = sorted({s for s in self._secrets if s}, key=len, reverse=True)
        assert parts.hostname, "check_http_url refuses a URL without a host"
        self.scheme, self.host, self.port = parts.scheme.lower(), parts.hostname, parts.port
        self.target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.timeout = float(cfg.timeout)
        self.retries = int(cfg.retries)
        self._conn: http.client.HTTPConnection | None = None
        """The kept-alive connection (http.client opens its socket again when the server has closed it)."""

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
                    wait = delay if err.retry_after is None else err.retry_after
                    if wait > self.max_retry_after:
                        raise self._error(f"{last}, longer than lmppo waits ({self.max_retry_after:g} s)") from None
                    time.sleep(wait)
                    delay = min(delay * 2, self.max_backoff)
        tries = f" (after {attempts} attempts)" if attempts > 1 else ""
        raise self._error(f"{last}{tries}")

    def close(self) -> None:
        """Close the kept-alive connection (the next call opens a new one)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            sock = conn.sock
            if sock is not None:  # wakes a request left behind by the deadline, blocked on this socket
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            conn.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _mask(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return redact_text(text)

    def _error(self, message: str) -> RewardError:
        return RewardError(self._mask(f"HTTP reward {self.shown_url}: {message}"))

    def _post(self, body: bytes) -> list:
        """One request, answered in full within `timeout` seconds in total (connecting, sending, and every byte
        of the answer: a server that trickles its answer cannot hold the run beyond it)."""
        box: dict = {}
        if self._conn is None:
            self._conn = self._open()
        conn = self._conn

        def attempt() -> None:
            try:
                box["answer"] = self._post_once(conn, body)
            except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = err

        worker = threading.Thread(target=attempt, name="lmppo-http-reward", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():  # left behind: closing its connection ends it; a daemon thread never blocks the exit
            self.close()
            raise _Retryable(self._timed_out())
        if "error" in box:
            if isinstance(box["error"], _Retryable):
                self.close()  # the connection's state is unknown after a failure: start the next try afresh
            raise box["error"]
        return box["answer"]

    def _timed_out(self) -> str:
        """One message whichever clock ran out first: the total deadline, or the socket's own timeout."""
        return f"no complete answer within {self.timeout:g} s (timeout: a total deadline per request)"

    def _open(self) -> http.client.HTTPConnection:
        """A connection to the server, or to the proxy the environment names for it (as urllib would use)."""
        self._target, self._headers = self.target, self.headers
        proxy = urllib.request.getproxies().get(self.scheme)
        if proxy and not urllib.request.proxy_bypass(self.host):
            p = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
            if not p.hostname:
                raise self._error(f"the {self.scheme} proxy the environment names ({redact_text(proxy)!r}) has no host")
            auth = {}
            if p.username is not None:
                pair = f"{urllib.parse.unquote(p.username)}:{urllib.parse.unquote(p.password or '')}"
                token = base64.b64encode(pair.encode()).decode()
                auth = {"Proxy-Authorization": f"Basic {token}"}
                self._secrets.append(token)
            if self.scheme == "https":
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    p.hostname, p.port or 8080, timeout=self.timeout, context=ssl.create_default_context()
                )
                conn.set_tunnel(self.host, self.port or 443, headers=auth)
            else:
                conn = http.client.HTTPConnection(p.hostname, p.port or 8080, timeout=self.timeout)
                host = f"[{self.host}]" if ":" in self.host else self.host
                self._target = f"http://{host}{f':{self.port}' if self.port else ''}{self.target}"  # the full URL
                self._headers = {**self.headers, **auth}
            return conn
        if self.scheme == "https":
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=self.timeout, context=ssl.create_default_context()
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)

    def _exchange(self, conn: http.client.HTTPConnection, body: bytes) -> tuple[int, Message, bytes]:
        """Send the request on `conn` and read the whole answer: (status, headers, body). The connection stays
        open for the next request unless the server says it closes it."""
        conn.request("POST", self._target, body=body, headers=self._headers)
        response = conn.getresponse()
        try:
            raw = response.read()
        except http.client.IncompleteRead as err:
            expected = f" of {len(err.partial) + err.expected}" if err.expected is not None else ""
            raise _Retryable(f"the answer was cut off after {len(err.partial)}{expected} bytes") from None
        return response.status, response.headers, raw

    def _post_once(self, conn: http.client.HTTPConnection, body: bytes) -> list:
        reused = conn.sock is not None
        try:
            try:
                status, headers, raw = self._exchange(conn, body)
            except _STALE:
                if not reused:
                    raise
                conn.close()  # the server closed the kept-alive connection while idle: once more on a new one
                status, headers, raw = self._exchange(conn, body)
        except (socket.timeout, TimeoutError):
            raise _Retryable(self._timed_out()) from None
        except ConnectionRefusedError:
            raise _Retryable("connection refused (is the server running, on that port?)") from None
        except ConnectionError as err:
            raise _Retryable(f"connection failed: {type(err).__name__}: {err}") from None
        except http.client.HTTPException as err:  # a malformed or cut-off status line or headers
            raise _Retryable(f"the answer was cut off or malformed ({type(err).__name__}: {str(err)[:200]})") from None
        except ssl.SSLError as err:
            raise _Retryable(f"TLS failed: {err.reason or err}") from None
        except OSError as err:
            raise _Retryable(f"cannot connect: {err.strerror or err}") from None
        if status != 200:
            msg = f"answered HTTP {status}: {_body_text(raw)!r}"
            if status in (429, 503):
                wait = retry_after_seconds(headers.get("Retry-After"), headers.get("Date"))
                if wait is not None:
                    raise _Retryable(f"{msg} (Retry-After: {wait:g} s)", retry_after=wait)
            if status == 429 or status >= 500:
                raise _Retryable(msg)
            if 400 <= status < 500:
                raise self._error(msg)
            raise self._error(f"answered HTTP {status} (expected 200): {_body_text(raw)!r}")
        try:
            answer: object = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise self._error(f"the answer is not JSON: {_body_text(raw)!r}") from None
        if isinstance(answer, dict):
            if "scores" not in answer:
                raise self._error(
                    f'the answer has keys {sorted(answer)[:10]}; expected {{"scores": [...]}} or a JSON list'
                )
            answer = answer["scores"]
        if not isinstance(answer, list):
            raise self._error(
                f"`scores` is a {type(answer).__name__} ({_body_text(raw)!r}); expected a list with "
                "one output per completion"
            )
        return answer


def retry_after_seconds(value: str | None, date: str | None = None, now: float | None = None) -> float | None:
    """Seconds to wait from a `Retry-After` header: a number of seconds, or an HTTP date (measured from the
    answer's own `Date` header when it has one, so the server's clock and ours need not agree). None when absent or
    unreadable; never negative."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
        return max(0.0, seconds) if math.isfinite(seconds) else None
    except ValueError:
        pass
    when = _http_date(value)
    if when is None:
        return None
    base = _http_date(date) if date else None
    start = base.timestamp() if base is not None else (time.time() if now is None else now)
    return max(0.0, when.timestamp() - start)


def _http_date(text: str) -> datetime.datetime | None:
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=datetime.timezone.utc)


def _body_text(raw: bytes, n: int = 200) -> str:
    return raw[: n * 4].decode("utf-8", errors="replace")[:n]
