"""Prefect's UI on our server: served at its root, behind its auth string.

At the root (HPC_GARAGE_PREFECT_UI=0 leaves it off), so the "View at" link Prefect prints opens. Its pages are public files, but every call for data goes to the API, behind the auth string (the UI's login
page asks for it, `hpc-garage server auth` prints it), and so do the event and log websockets (Prefect checks
their in-band auth message since PrefectHQ/prefect#17741; seen on 3.8.8 and 3.9.1, tests/test_prefect_ui.py
checks every route). The UI asks for the API at `/api` of the page it was loaded from, so it works through any
`ssh -L` tunnel. Prefect copies its UI (15 MiB) into PREFECT_HOME/ui_build on a server's first start (0.2–0.4
s; the package's own directory may be read-only on a site); the server's memory is the same with or without it
(`python -m bench --only ui`).
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from pathlib import Path

from hpc_garage.core.tunnel import ssh_tunnel
from hpc_garage.prefect.server.state import LOOPBACK, ServerState, url_host
from hpc_garage.variables import PREFECT_UI, switch


def ui_status(state: ServerState, state_file: str) -> dict[str, str]:
    """Where the UI is, the line that reaches it from a laptop, and where its auth string is (never the string)."""
    if not state.ui:
        return {"ui": f"off: this server was started without it ({PREFECT_UI}=0, or an older hpc-garage); "
                      "`hpc-garage server stop` once no run uses it, and the next run starts one with it"}
    import getpass
    from urllib.parse import urlsplit

    where = "" if state.host in (LOOPBACK, "localhost") else f" --host {state.host}"
    path = urlsplit(state.ui).path
    return {"ui": f"{state.ui}/",
            "from_a_laptop": ssh_tunnel(state.host if state.host not in ("0.0.0.0", "::") else url_host(state.host),
                                        state.port, f"{getpass.getuser()}@{socket.getfqdn()}", f"{path}/"),
            "auth_string": f"the UI's login page asks for it: `hpc-garage server auth{where}` prints it "
                           f"(key \"auth\" of {state_file})"}


def ui_base(root: str, env: Mapping[str, str]) -> str:
    """The UI's base URL under the server's `root`: `/v2` where Prefect ships its V2 UI and the user did not
    turn it off. Its pages send a browser without the auth string to its login page and back; the V1 UI's
    deep links (Prefect's default "View at" link) show "Page not found" instead."""
    prefect = prefect_dir()
    has_v2 = prefect is not None and (prefect / "server" / "ui-v2" / "index.html").exists()
    return f"{root}/v2" if has_v2 and switch(env, "PREFECT_SERVER_UI_V2_ENABLED", True) else root


def ui_settings(home: Path, ui: str) -> dict[str, str]:
    """Prefect's settings for our server's UI (at base URL `ui`; "": off). Its API at `/api` of whatever
    address the page was loaded from (a laptop's `ssh -L` port, the node's name or IP: the server cannot
    know which); its copy of the UI in our PREFECT_HOME (Prefect's default is inside the installed package,
    often read-only on a site); the links the server writes itself (automations' notifications) at `ui`."""
    if not ui:
        return {"PREFECT_SERVER_UI_ENABLED": "false"}
    return {"PREFECT_SERVER_UI_ENABLED": "true", "PREFECT_SERVER_UI_API_URL": "/api",
            "PREFECT_SERVER_UI_STATIC_DIRECTORY": str(home / "ui_build"), "PREFECT_UI_URL": ui,
            "PREFECT_SERVER_UI_SERVE_BASE": "/"}


def prefect_dir() -> Path | None:
    """The installed prefect package's directory, found without importing it (≈2 s)."""
    import importlib.util

    spec = importlib.util.find_spec("prefect")
    for location in (spec.submodule_search_locations or []) if spec else []:
        return Path(location)
    return None
