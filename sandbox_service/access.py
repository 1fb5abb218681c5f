"""Who may use the sandbox service: the bearer token, the bind rule, and which run a request names.

This module owns the service's access policy. A service reachable beyond loopback (`serve --host
0.0.0.0`) exposes create / exec / upload of every sandbox to whoever reaches the port, so it
refuses to bind there without a token (`check_bind`). With a token, every request must carry
`Authorization: Bearer <token>` (compared in constant time, `hmac.compare_digest`); the token
comes from a file (`--token-file`, its first line) or an environment variable (`--token-env`,
default `T1JAX_SANDBOX_TOKEN` for the client). Every request that touches sandboxes names its run
(`X-T1jax-Run`, `RUN_HEADER`) and reaches only that run's trials: another run's sandbox is
answered as unknown (404), so one run can neither drive nor discover another's.

Invariants:
- `check_bind(host, token)` raises `AccessRefused` for a non-loopback host (a name resolving to
  any non-loopback address counts as one) when `token` is None or empty.
- `token_matches` never short-circuits on the token's content.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import socket
from dataclasses import dataclass
from pathlib import Path

TOKEN_ENV = "T1JAX_SANDBOX_TOKEN"
RUN_HEADER = "X-T1jax-Run"
MIN_TOKEN_CHARS = 16


class AccessRefused(ValueError):
    """The service would be open to others (or the token given is unusable)."""


@dataclass(frozen=True)
class AccessPolicy:
    """`token` None: no authentication (allowed on loopback only, see `check_bind`)."""

    token: str | None = None

    def authorizes(self, header: str | None) -> bool:
        if self.token is None:
            return True
        scheme, _, given = (header or "").partition(" ")
        return scheme.lower() == "bearer" and token_matches(given.strip(), self.token)


def token_matches(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def load_token(*, token_file: Path | None = None, token_env: str | None = None) -> str | None:
    """The token from `token_file` (first line) or the variable `token_env`; None if neither is
    given. Raises `AccessRefused` naming what is wrong (missing file, empty or short token)."""
    if token_file is not None:
        try:
            lines = Path(token_file).read_text(encoding="utf-8").splitlines()
        except OSError as error:
            raise AccessRefused(f"cannot read the token file {token_file}: {error.strerror}") from None
        token, source = (lines[0].strip() if lines else ""), f"token file {token_file}"
    elif token_env is not None:
        token, source = os.environ.get(token_env, "").strip(), f"environment variable {token_env}"
    else:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise AccessRefused(f"the {source} holds no token of at least {MIN_TOKEN_CHARS} characters")
    return token


def is_loopback(host: str) -> bool:
    """Whether every address `host` names is a loopback address (an unresolvable name is not)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def check_bind(host: str, token: str | None) -> None:
    if not token and not is_loopback(host):
        raise AccessRefused(
            f"refusing to serve on {host}, beyond loopback, without a token: anyone reaching the port "
            "could create sandboxes and run commands in them (give --token-file FILE or --token-env VAR)"
        )
