"""Which Prefect API the flow and every worker use: the user's, else hpc-garage's managed server.

Without a configured API, Prefect starts a temporary server in the flow process *and in every Dask worker* (all
on one SQLite file: "database is locked", 20–25 s before the first task). So `ensure_api` returns the
environment that points the flow and every worker at a single API.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpc_garage.prefect.server.managed import START_TIMEOUT, ensure_server
from hpc_garage.prefect.server.state import LOOPBACK
from hpc_garage.prefect.server.ui import prefect_dir
from hpc_garage.variables import PREFECT_SERVER_ENV


def ensure_api(host: str = LOOPBACK, *, env: Mapping[str, str] | None = None,
               timeout: float = START_TIMEOUT) -> dict[str, str]:
    """The environment to export to the flow and every worker so that all of them use one Prefect API.

    The user's API when one is configured (PREFECT_API_URL in the environment or the active profile);
    otherwise our server on `host` for this machine, reused if it answers, else started.
    """
    env = os.environ if env is None else env
    if url := configured_api_url(env):  # its auth string and managed-server note travel with it (a deployment's job)
        return {"PREFECT_API_URL": url, **{k: env[k] for k in ("PREFECT_API_AUTH_STRING", "PREFECT_API_KEY",
                                                              PREFECT_SERVER_ENV) if env.get(k)}}
    return ensure_server(host, timeout=timeout).client_env()


def configured_api_url(env: Mapping[str, str]) -> str | None:
    """PREFECT_API_URL as Prefect would resolve it: the environment, else the active profile."""
    if url := env.get("PREFECT_API_URL", "").strip():
        return url
    profiles = _builtin_profiles()
    home = Path(env.get("PREFECT_HOME") or "~/.prefect").expanduser()
    path = Path(env.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    user = _read_toml(path)
    for name, settings in user.get("profiles", {}).items():
        profiles[name] = {**profiles.get(name, {}), **settings}
    active = env.get("PREFECT_PROFILE") or user.get("active") or "ephemeral"
    url = profiles.get(active, {}).get("PREFECT_API_URL")
    return str(url) if url else None


def _builtin_profiles() -> dict[str, dict[str, Any]]:
    """Prefect's shipped profiles (`local` points at 127.0.0.1:4200), found without importing prefect."""
    prefect = prefect_dir()
    return dict(_read_toml(prefect / "settings" / "profiles.toml").get("profiles", {})) if prefect else {}


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return {}
