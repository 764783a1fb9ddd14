"""The API key: where it comes from (a file or LINESIDE_API_KEY, so it stays out of `ps`) and which paths
need it. Without a key only liveness and readiness answer (what orchestrators probe); /metrics too
when the operator makes it public."""

from __future__ import annotations

import hmac
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from lineside.errors import LinesideError

log = logging.getLogger("lineside.server")

API_KEY_ENV = "LINESIDE_API_KEY"
PROBE_PATHS = frozenset({"/health", "/health/ready"})


def read_key_file(path: Path) -> str:
    """The key in ``path`` (one line; surrounding whitespace dropped); LinesideError naming the file otherwise."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise LinesideError(f"--api-key-file {path}: no such file; write the key into it (one line)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise LinesideError(f"--api-key-file {path}: cannot read it ({e})") from None
    key = text.strip()
    if not key or "\n" in key:
        raise LinesideError(f"--api-key-file {path}: expected one line holding the key, found "
                            f"{'nothing' if not key else 'several lines'}")
    try:
        if path.stat().st_mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning("%s is readable by other users; chmod 600 it", path)
    except OSError:
        pass
    return key


def resolve_api_key(cli_key: str | None, key_file: Path | None) -> str | None:
    """One key from --api-key-file, LINESIDE_API_KEY or --api-key (the last shows in `ps`: a warning says so)."""
    env_key = os.environ.get(API_KEY_ENV) or None
    if key_file is not None:
        if cli_key is not None and cli_key != env_key:
            raise LinesideError("give the API key once: --api-key-file or --api-key, not both")
        return _sendable(read_key_file(key_file), f"--api-key-file {key_file}")
    if cli_key is not None and cli_key != env_key:
        log.warning("--api-key on the command line is visible to every user in `ps`; use --api-key-file FILE "
                    "or the %s environment variable", API_KEY_ENV)
    key = cli_key if cli_key is not None else env_key
    if key is None and API_KEY_ENV in os.environ:
        # set but empty (a secret that was never filled in, an EnvironmentFile line without a value): serving with no
        # key would open the server where its operator meant to close it, with nobody watching
        raise LinesideError(f"{API_KEY_ENV} is set but empty; give it the key, or unset it to serve without one")
    if key is None:
        return None
    if not key.strip():
        raise LinesideError("the API key is empty; set a non-empty key or none")
    # surrounding whitespace dropped, as from the key file (a secret mounted with its newline): a client's token
    # is compared stripped, so a key kept whole matched no client
    return _sendable(key.strip(), "the API key")


def _sendable(key: str, where: str) -> str:
    """``key`` when a client can send it in an Authorization header (printable ASCII: httpx and the openai client
    refuse anything else, and the header arrives as bytes); LinesideError otherwise, without printing the key."""
    if not all(" " <= ch <= "~" for ch in key):
        raise LinesideError(f"{where}: the key must be printable ASCII (it travels in the Authorization header, "
                            "which clients send as ASCII); choose one without accents, tabs or control characters")
    return key


@dataclass(frozen=True)
class AccessPolicy:
    """Which requests need ``Authorization: Bearer <key>``: all but the probes when a key is set."""

    api_key: str | None
    metrics_public: bool = False

    def needs_key(self, path: str) -> bool:
        """Any method: a CORS preflight carries no credentials, but CORSMiddleware answers it before the key is
        asked for, and an OPTIONS that is not one must not reach the routes unauthenticated."""
        if self.api_key is None:
            return False
        if path in PROBE_PATHS:
            return False
        return not (self.metrics_public and path == "/metrics")

    def key_matches(self, authorization: str) -> tuple[bool, str]:
        """(accepted, what was wrong) for an Authorization header value."""
        token = authorization[7:].strip() if authorization[:7].lower() == "bearer " else ""
        if not token:
            return False, "missing API key"
        assert self.api_key is not None
        return hmac.compare_digest(token.encode(), self.api_key.encode()), "wrong API key"
