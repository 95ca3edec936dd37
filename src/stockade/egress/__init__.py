"""Controlled egress: a sandbox reaches the hosts its policy allows, through a proxy on the
host, and the credentials for them never enter it.

    from stockade import Sandbox
    from stockade.egress import Credential, EnvSecret, NetworkPolicy

    network = NetworkPolicy(
        allow_hosts=("pypi.org", "files.pythonhosted.org", "*.github.com"),
        credentials=(Credential(name="github", hosts=("api.github.com",), source=EnvSecret("GITHUB_TOKEN")),),
    )
    with Sandbox.create(network=network) as sbx:
        sbx.commands.run("pip install requests && curl https://api.github.com/user")

Each sandbox gets a proxy of its own (``EgressProxy``), reachable only from inside it; see
``docs/architecture.md`` for how each tier gets there, and ``proxy.py`` for what it allows.
"""

from stockade.egress._attach import PROXY_PORT, SANDBOX_DIR, Attachment, attach, attach_port, proxy_env
from stockade.egress._rules import Judge, Verdict
from stockade.egress.proxy import EgressObserver, EgressProxy, Resolver, SystemResolver
from stockade.egress.secrets import EnvSecret, FileSecret, register_scheme, secret_source
from stockade.types import Credential, EgressRecord, HostRule, NetworkPolicy

__all__ = [
    "PROXY_PORT",
    "SANDBOX_DIR",
    "Attachment",
    "Credential",
    "EgressObserver",
    "EgressProxy",
    "EgressRecord",
    "EnvSecret",
    "FileSecret",
    "HostRule",
    "Judge",
    "NetworkPolicy",
    "Resolver",
    "SystemResolver",
    "Verdict",
    "attach",
    "attach_port",
    "proxy_env",
    "register_scheme",
    "secret_source",
]
