"""The one TLS context every client the addon makes shares.

httpx builds a context for each client it makes unless given one: reading and parsing the
CA bundle, 26 ms of CPU here, in the event loop that carries every stream. Clients made
in the middle of answers (a shadow's or a migration's first, a health question asked
once, a fan-out to sibling workers) would stall every stream for as long. The context is
built once, at the addon's start, as httpx builds its own (`SSL_CERT_FILE` and
`SSL_CERT_DIR` honoured, certifi's bundle otherwise)."""

from __future__ import annotations

import functools
import ssl

import httpx


@functools.cache
def tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()
