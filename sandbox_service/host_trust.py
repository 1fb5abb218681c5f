"""The host's extra certificate authorities, for builds and sandboxes that reach the network.

This module owns one fact about the host: whether it trusts certificate authorities beyond the
public ones (a site CA, or a TLS-inspecting egress proxy's CA, installed in
`/usr/local/share/ca-certificates/` as Debian expects). Behind such a proxy every HTTPS download
from an image's own trust store fails (pip: CERTIFICATE_VERIFY_FAILED), so the backends hand the
host's whole CA bundle to what reaches the network: every Dockerfile build step, and a sandbox only
when the task's internet is granted. The bundle is bind-mounted read-only at `CA_MOUNT` (on
/dev/shm, a tmpfs in every build step and sandbox, so it never lands in an image layer) and named
by the variables common tools read (`trust_env`); the image's own trust store is left untouched.

Invariant: `host_ca_bundle()` is None on a host without extra CAs, and then nothing is mounted or set.
"""

from __future__ import annotations

from pathlib import Path

LOCAL_CA_DIR = Path("/usr/local/share/ca-certificates")
HOST_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
CA_MOUNT = "/dev/shm/.t1jax-host-ca.crt"
_VARIABLES = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "PIP_CERT", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO",
              "NODE_EXTRA_CA_CERTS", "CARGO_HTTP_CAINFO")  # fmt: skip


def host_ca_bundle() -> Path | None:
    """The host's CA bundle, if the host trusts CAs of its own (else None)."""
    if HOST_BUNDLE.is_file() and LOCAL_CA_DIR.is_dir() and any(LOCAL_CA_DIR.rglob("*.crt")):
        return HOST_BUNDLE
    return None


def trust_env() -> dict[str, str]:
    """Variables pointing TLS clients (openssl, python, requests, pip, curl, git, node, cargo) at CA_MOUNT."""
    return dict.fromkeys(_VARIABLES, CA_MOUNT)
