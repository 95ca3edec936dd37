"""The Python client of ``stockade serve``: the SDK's nouns and errors, remote (on httpx2).

Moving code from a local sandbox to the service is one line:

    from stockade import Sandbox                             # local
    from stockade.client import RemoteSandbox as Sandbox     # the service (STOCKADE_URL, STOCKADE_TOKEN)

    from stockade import AsyncSandbox                                   # local, asyncio
    from stockade.client import AsyncRemoteSandbox as AsyncSandbox      # the service, asyncio

Errors are the SDK's own classes (``stockade.exceptions``), raised from the service's problem
documents; ``ServiceUnavailable`` when the service cannot be reached.
"""

from stockade.client.async_client import AsyncClient, AsyncRemoteRun, AsyncRuns
from stockade.client.async_sandbox import AsyncRemoteSandbox
from stockade.client.client import Client, RemoteRun, RunEvent, Runs
from stockade.client.sandbox import RemoteSandbox

__all__ = [
    "AsyncClient",
    "AsyncRemoteRun",
    "AsyncRemoteSandbox",
    "AsyncRuns",
    "Client",
    "RemoteRun",
    "RemoteSandbox",
    "RunEvent",
    "Runs",
]
