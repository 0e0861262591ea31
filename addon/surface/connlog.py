"""Whether mitmproxy logs a line for each connection it opens and closes.

mitmproxy says `client connect`, `server connect 127.0.0.1:8081`, their disconnects, and
`Streaming response from HOST.` for each streamed answer; with the addon, each spliced
answer's connection to its own endpoint (answer/endpoint.py) reads there as a server
connect to a random port of 127.0.0.1, which looks like the proxy talking to the wrong
server. `spillover run` turns these lines off unless asked for them (`-v`); handoffs,
warnings and errors are logged either way.
"""

from __future__ import annotations

import logging

from mitmproxy import ctx

CONNECTIONS = logging.getLogger("mitmproxy.proxy.server")  # (where mitmproxy says them)
LINES = (
    "client connect", "client disconnect", "server connect", "server disconnect",
    "Streaming response from ", "Streaming request to ",
)  # fmt: skip


def not_a_connection_line(record: logging.LogRecord) -> bool:
    return record.levelno > logging.INFO or not record.getMessage().startswith(LINES)


class ConnectionLog:
    def load(self, loader) -> None:
        loader.add_option(
            "spillover_log_connections", bool, True,
            "Log mitmproxy's line for each client and server connect and disconnect and "
            "each streamed flow, the splice endpoint's too (mitmproxy's own default). "
            "`spillover run` sets it to false unless given -v.",
        )  # fmt: skip

    def configure(self, updated: set[str]) -> None:
        if "spillover_log_connections" in updated:
            CONNECTIONS.removeFilter(not_a_connection_line)
            if not ctx.options.spillover_log_connections:
                CONNECTIONS.addFilter(not_a_connection_line)
