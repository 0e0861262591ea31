"""A plain relay in front of a real server that lets only the OpenAI routes through, as a
gateway or a hosted API shows a server: HAProxy (a real component, as in front of the
workers) answering 404 for everything else (`/props`, `/tokenize`, `/apply-template`,
`/slots`, llama-cpp-python's `/extras/...`). Or, with a certificate, the server behind
TLS, as on another machine of an operator's network."""

from __future__ import annotations

import ssl
from pathlib import Path
from urllib.parse import urlsplit

from scripts.parts.processes import ManagedProcess
from scripts.workers.pool import haproxy_binary

OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health")

CONFIG = """global
    maxconn 256
defaults
    mode http
    timeout connect 5s
    timeout client 300s
    timeout server 300s
frontend relay
    bind 127.0.0.1:{port}{tls}
    acl openai {match} {routes}
    http-request return status 404 content-type text/plain string "not found" unless openai
    default_backend server
backend server
    server only {address}
"""


class Relay(ManagedProcess):
    name = "relay"
    health_path = "/v1/models"  # (llama-cpp-python has no /health)

    def __init__(
        self,
        target: str,
        log_dir: Path | None = None,
        every_route: bool = False,
        tls: tuple[Path, Path] | None = None,
    ) -> None:
        """`every_route`: let every route through (the server under a second address);
        `tls`: the CA's certificate and the relay's own (tlscerts.py), served on https."""
        super().__init__(None, log_dir)
        self.target = urlsplit(target)
        self.every_route = every_route
        self.config = self.log_path.with_suffix(".cfg")
        self.certificate = tls[1] if tls else None
        if tls:
            self.scheme, self.verify = "https", ssl.create_default_context(cafile=tls[0])

    def argv(self) -> list[str]:
        address = f"{self.target.hostname}:{self.target.port}"
        routes = "/" if self.every_route else " ".join(OPENAI_ROUTES)
        match = "path_beg" if self.every_route else "path"
        tls = f" ssl crt {self.certificate}" if self.certificate else ""
        config = CONFIG.format(port=self.port, tls=tls, match=match, routes=routes, address=address)
        self.config.write_text(config)
        return [haproxy_binary(), "-db", "-f", str(self.config)]
