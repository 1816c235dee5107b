"""Prefect's REST API over plain HTTP: the one client hpc-garage's own calls go through (a run's progress and
crash marking, the GPU-figure artifacts, the outage probe, the managed server's health checks).

Plain urllib, not Prefect's client: `cluster/` must not import Prefect (about 2 s, in the run's scheduler
process), and these are a few JSON calls. One client, so that three things are the same everywhere:
- the auth header, as Prefect's own client sends it: `Basic` of PREFECT_API_AUTH_STRING, else `Bearer`
  PREFECT_API_KEY;
- the proxy policy: hpc-garage's own addresses never go through a proxy (loopback, the managed server, and the
  hosts hpc-garage hands out, which `no_proxy_for` adds to NO_PROXY/no_proxy wherever it hands them out, so that
  Prefect's own clients skip the proxy for them too); every other host follows the user's proxy variables;
- the time: each call at most `timeout` seconds; with `budget`, all the calls of one client at most that.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from hpc_garage.variables import PREFECT_SERVER_ENV

__all__ = ["Answer", "ApiError", "PrefectApi", "auth_headers", "no_proxy_for", "proxy_for", "server_host"]

CALL_TIMEOUT = 5.0  # s one call may take, unless the caller says otherwise
BUSY = (429, 503)  # "busy, ask again": a Prefect server answers 503 for a database error a client can retry on
BUSY_RETRIES = 5  # as Prefect's own client (PREFECT_CLIENT_MAX_RETRIES' default)
BUSY_DELAY_MAX = 10.0  # s between two tries at most
NO_PROXY_NAMES = ("NO_PROXY", "no_proxy")  # both spellings: curl and httpx read either, urllib prefers no_proxy


def auth_headers(api: Mapping[str, str]) -> dict[str, str]:
    """The header Prefect's client sends for the auth string or API key in `api` (PREFECT_API_* names)."""
    if auth := api.get("PREFECT_API_AUTH_STRING"):
        return {"Authorization": f"Basic {base64.b64encode(auth.encode()).decode()}"}
    if key := api.get("PREFECT_API_KEY"):
        return {"Authorization": f"Bearer {key}"}
    return {}


def proxy_for(url: str, env: Mapping[str, str] | None = None, *, own: bool = False) -> str | None:
    """The proxy a call to `url` goes through, by the policy above; None: straight there. `own`: the URL is one
    hpc-garage hands out (its managed server), whatever the environment says. `env`: the proxy variables'
    environment (this process's by default), read as urllib reads them (the lowercase spelling wins)."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if own or _loopback(host):
        return None
    proxies = _proxy_variables(os.environ if env is None else env)
    if urllib.request.proxy_bypass_environment(parts.netloc.rsplit("@", 1)[-1].lower(), proxies):
        return None
    return proxies.get(parts.scheme)


def no_proxy_for(hosts: Iterable[str | None], env: Mapping[str, str]) -> dict[str, str]:
    """NO_PROXY and no_proxy as in `env`, with each of `hosts` (addresses hpc-garage hands out: its server, the
    scheduler, the dashboard) appended where missing, for the caller to put into the environment of a process:
    Prefect's httpx and websockets clients then reach them straight, not through a site's http_proxy. Where
    only one spelling is set, both start from it, so that neither drops what the user listed."""
    wanted = [h.strip("[]") for h in hosts if h and h.strip("[]") not in ("0.0.0.0", "::")]
    result = {}
    for name, other in zip(NO_PROXY_NAMES, reversed(NO_PROXY_NAMES)):
        listed = [entry.strip() for entry in (env.get(name) or env.get(other) or "").split(",") if entry.strip()]
        result[name] = ",".join([*listed, *(h for h in dict.fromkeys(wanted) if h not in listed)])
    return result


def server_host(api: Mapping[str, str]) -> str | None:
    """The host of hpc-garage's managed server where these PREFECT_API_* settings name it (`ensure_api` adds
    PREFECT_SERVER_ENV to them); None for any other API, which follows the user's proxy settings."""
    if PREFECT_SERVER_ENV not in api or not api.get("PREFECT_API_URL"):
        return None
    return urlsplit(api["PREFECT_API_URL"]).hostname


class ApiError(OSError):
    """The API answered, with an error status (an OSError, as a connection that failed is)."""

    def __init__(self, status: int, url: str, body: bytes) -> None:
        super().__init__(f"HTTP {status} from {url}: {body[:200].decode(errors='replace')}")
        self.status = status


@dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes
    headers: Mapping[str, str] = field(default_factory=dict)  # names in lowercase

    def json(self) -> Any:
        return json.loads(self.body or b"null")

    def retry_after(self) -> float | None:
        """The seconds a Retry-After header asks for (its number form); None where it gives none."""
        try:
            return max(float(self.headers.get("retry-after", "")), 0.0)
        except ValueError:
            return None


class PrefectApi:
    """Calls to one Prefect API (`url`: PREFECT_API_URL, ending in /api; or a server's root for its UI)."""

    def __init__(self, url: str, *, headers: Mapping[str, str] | None = None, timeout: float = CALL_TIMEOUT,
                 budget: float | None = None, own: bool = False, verify: bool | str = True) -> None:
        """`budget`: seconds for all calls from now (then each call gets what is left, and none once it is spent);
        `own`: an address hpc-garage hands out (never proxied); `verify`: False, or a CA file, for HTTPS."""
        self.url = url.rstrip("/")
        self.headers = dict(headers or {})
        self.timeout = timeout
        self.budget = budget
        self.own = own
        self.deadline = None if budget is None else time.monotonic() + budget
        proxy = proxy_for(self.url, own=own)
        handlers: list[urllib.request.BaseHandler] = [
            urllib.request.ProxyHandler({urlsplit(self.url).scheme: proxy} if proxy else {})]
        if verify is not True and urlsplit(self.url).scheme == "https":
            context = ssl.create_default_context(cafile=verify if isinstance(verify, str) else None)
            if verify is False:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            handlers.append(urllib.request.HTTPSHandler(context=context))
        self.opener = urllib.request.build_opener(*handlers)

    @classmethod
    def from_env(cls, api: Mapping[str, str], **options: Any) -> PrefectApi | None:
        """The client for the API these PREFECT_API_* settings name (as `ensure_api` gives them); None: no API.
        The managed server's settings carry PREFECT_SERVER_ENV: its address is hpc-garage's own."""
        if not (url := api.get("PREFECT_API_URL")):
            return None
        options.setdefault("own", server_host(api) is not None)
        return cls(url, headers=auth_headers(api), **options)

    def answer(self, method: str, path: str, body: Any = None) -> Answer:
        """One call, whatever status it answers with; an OSError (TimeoutError included) where none came."""
        timeout = self.timeout
        if self.deadline is not None:
            timeout = min(timeout, self.deadline - time.monotonic())
            if timeout <= 0:
                raise TimeoutError(f"out of time ({self.budget:g} s for all calls to {self.url})")
        data = None if body is None else json.dumps(body).encode()
        headers = self.headers | ({"Content-Type": "application/json"} if data is not None else {})
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method, headers=headers)
        try:
            with self.opener.open(request, timeout=timeout) as response:
                return Answer(response.status, response.headers.get("content-type", ""), response.read(),
                              _lowercase(response.headers))
        except urllib.error.HTTPError as exc:
            with exc:
                headers = _lowercase(exc.headers) if exc.headers else {}
                return Answer(exc.code, headers.get("content-type", ""), exc.read(), headers)

    def call(self, method: str, path: str, body: Any = None) -> Any:
        """The JSON of a successful call (None for an empty body); ApiError for an error status. A busy answer
        (429, 503: a Prefect server under load, its SQLite locked) is asked again, as Prefect's own client does:
        up to BUSY_RETRIES times, after its Retry-After or a doubling delay, never past the budget."""
        for attempt in range(BUSY_RETRIES + 1):
            answer = self.answer(method, path, body)
            if answer.status not in BUSY or attempt == BUSY_RETRIES:
                break
            after = answer.retry_after()
            delay = min(0.5 * 2 ** attempt if after is None else after, BUSY_DELAY_MAX)
            if self.deadline is not None and time.monotonic() + delay >= self.deadline:
                break
            time.sleep(delay)
        if not 200 <= answer.status < 300:
            raise ApiError(answer.status, f"{self.url}{path}", answer.body)
        return answer.json()

    def get(self, path: str) -> Any:
        """The JSON of a successful GET; ApiError for an error status."""
        return self.call("GET", path)

    def post(self, path: str, body: Any) -> Any:
        """The JSON of a successful POST of `body` as JSON; ApiError for an error status."""
        return self.call("POST", path, body)


def _lowercase(headers: Any) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def _loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _proxy_variables(env: Mapping[str, str]) -> dict[str, str]:
    """{scheme: proxy, "no": no_proxy} from `env`, as urllib.request.getproxies_environment reads os.environ:
    any case counts, and a lowercase variable (even an empty one) wins over its uppercase twin."""
    proxies: dict[str, str] = {}
    for name, value in env.items():
        if value and name.lower().endswith("_proxy"):
            proxies[name.lower()[:-6]] = value
    for name, value in env.items():
        if name.endswith("_proxy"):
            if value:
                proxies[name.lower()[:-6]] = value
            else:
                proxies.pop(name.lower()[:-6], None)
    return proxies
