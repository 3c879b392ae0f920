"""Masking credentials in text (URL user info, secret query parameters, env-style assignments, bearer values,
well-known token shapes) before it reaches a message, a file or a tracker. A leaf module: `lmppo.errors` masks
config values in its messages with it, `lmppo.run.config_file` masks the config files it writes."""

from __future__ import annotations

import re

MASK = "***"
_SECRET_NAME = (
    r"(?:token|secret|passw(?:or)?d|passwd|pwd|api[_-]?key|apikey|access[_-]?key|private[_-]?key|auth\w*"
    r"|credentials?|cookie|session[_-]?id|sig|signature)"
)
_URL_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s?#]*@")
_QUERY_SECRET = re.compile(r"(?i)([?&;][\w.-]*" + _SECRET_NAME + r"[\w.-]*=)[^&#\s]*")
_ENV_ASSIGN = re.compile(
    r"\b([A-Z][A-Z0-9_]*(?:TOKEN|SECRET|PASSWORD|PASSWD|PWD|API_KEY|APIKEY|ACCESS_KEY|"
    r"PRIVATE_KEY|CREDENTIALS?|AUTH)[A-Z0-9_]*)=(\S+)"
)
_TOKEN_SHAPES = re.compile(
    r"\b(?:hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{20,}|gh[pousr]_[A-Za-z0-9]{20,}|"
    r"github_pat_[A-Za-z0-9_]{20,}|xox[abposr]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16}|"
    r"glpat-[A-Za-z0-9_-]{20,})"
)
_AUTH_HEADER = re.compile(r"(?i)\b(bearer|basic|token)\s+[A-Za-z0-9._~+/=-]{8,}")
_SECRET_KEY = re.compile(r"(?i)" + _SECRET_NAME)
ENV_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
"""`${NAME}`: a value taken from environment variable NAME when used (HTTP reward headers), never stored expanded."""
_AUTH_SCHEME = re.compile(r"(?i)\s*(?:bearer|basic|token|apikey|api-key)?\s*")


def is_env_template(text: str) -> bool:
    """True when `text` holds its secret only as `${NAME}` references: besides them at most an auth scheme word
    (`Bearer ${TOKEN}`). Such a value is safe to write down; anything else under a secret-looking name is masked."""
    return bool(ENV_REFERENCE.search(text)) and _AUTH_SCHEME.fullmatch(ENV_REFERENCE.sub("", text)) is not None


def redact_text(text: str) -> str:
    """`text` with credentials masked: `user:pass@` in URLs, secret query parameters (`?token=...`),
    env-style assignments (`HF_TOKEN=...`), `Bearer ...` values and well-known token shapes (hf_, sk-, ghp_, ...)."""
    text = _URL_USERINFO.sub(lambda m: m.group(1) + MASK + "@", text)
    text = _QUERY_SECRET.sub(lambda m: m.group(1) + MASK, text)
    text = _ENV_ASSIGN.sub(lambda m: m.group(1) + "=" + MASK, text)
    text = _AUTH_HEADER.sub(lambda m: m.group(1) + " " + MASK, text)
    return _TOKEN_SHAPES.sub(MASK, text)
