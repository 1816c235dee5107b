"""The `ssh -N -L` line that reaches a web page on a compute or login node from a laptop.

Written once for every page hpc-garage points at (the Dask dashboard, the Prefect UI): a site's nodes are
seldom reachable from outside, its login node is.
"""

from __future__ import annotations


def ssh_tunnel(host: str, port: int, login: str, path: str = "/", *, local_port: int | None = None) -> str:
    """`ssh -N -L LOCAL:HOST:PORT LOGIN  then open http://localhost:LOCAL/PATH`; LOCAL defaults to PORT, so
    links that name the port (Prefect's "View at") still work with `localhost` for the host."""
    local = port if local_port is None else local_port
    target = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"ssh -N -L {local}:{target}:{port} {login}  then open http://localhost:{local}/{path.lstrip('/')}"
