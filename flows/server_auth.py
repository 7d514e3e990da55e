"""Refuse to talk to a Prefect server beyond loopback without credentials.

No Prefect import at module level (``flows/pipeline.py``'s fast path uses it). A server started with
``--host 0.0.0.0`` and no ``PREFECT_SERVER_API_AUTH_STRING`` lets anyone who reaches its port trigger
runs, register a deployment whose pull steps run shell commands on the workers, and read every log.
``check_api_auth`` reads Prefect's own settings (environment, ``.env`` or the active profile): an API
URL whose host is not a loopback address needs ``PREFECT_API_AUTH_STRING`` (a self-hosted server's
basic authentication) or ``PREFECT_API_KEY`` (Prefect Cloud), unless the caller passes
``allow_unauthenticated`` (``--allow-unauthenticated``: e.g. a server behind an authenticating proxy).
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlparse

ALLOW_FLAG = "--allow-unauthenticated"


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if not host:
        return False
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unauthenticated_remote(url: str | None, auth_string: str | None, api_key: str | None) -> str | None:
    """The refusal line for an API ``url`` beyond loopback with neither credential, else None."""
    if not url or is_loopback(urlparse(url).hostname) or auth_string or api_key:
        return None
    return (f"PREFECT_API_URL {url} is not on loopback and neither PREFECT_API_AUTH_STRING nor PREFECT_API_KEY "
            f"is set: anyone who reaches that server can run commands on its workers; set PREFECT_API_AUTH_STRING "
            f"to the server's PREFECT_SERVER_API_AUTH_STRING (docs/orchestration.md), or pass {ALLOW_FLAG} "
            "(e.g. behind an authenticating proxy)")


def check_api_auth(allow_unauthenticated: bool = False) -> str | None:
    """``unauthenticated_remote`` for Prefect's current settings; None when allowed."""
    if allow_unauthenticated:
        return None
    from prefect.settings import get_current_settings

    api = get_current_settings().api
    auth, key = (s.get_secret_value() if s is not None else None for s in (api.auth_string, api.key))
    return unauthenticated_remote(api.url, auth, key)
