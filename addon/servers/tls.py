"""The one TLS context every connection the addon makes shares, verified as mitmproxy
verifies its own.

httpx builds a context for each client it makes unless given one: reading and parsing the
CA bundle, 26 ms of CPU here, in the event loop that carries every stream (asyncio does
the same for each `https` connection made without one). Clients made in the middle of
answers (a leg, a shadow's or a migration's first, a health question, a fan-out to
sibling workers) would stall every stream for as long. The context is built once, as
httpx builds its own (`SSL_CERT_FILE` and `SSL_CERT_DIR` honoured, certifi's bundle
otherwise, as mitmproxy's), and mitmproxy's options for its upstreams apply to it:
`ssl_insecure`, and the CAs of `ssl_verify_upstream_trusted_ca` and `_confdir`, trusted
besides the bundle's. It is changed in place, so clients already made follow a change."""

from __future__ import annotations

import functools
import ssl

import httpx

OPTIONS = {"ssl_insecure", "ssl_verify_upstream_trusted_ca", "ssl_verify_upstream_trusted_confdir"}


@functools.cache
def tls_context() -> ssl.SSLContext:
    return httpx.create_ssl_context()


def use_upstream_tls(insecure: bool, ca_file: str | None, ca_dir: str | None) -> str | None:
    """Verify servers as mitmproxy's options say (`insecure`: not at all); the mistake, in
    words, where the CAs cannot be read (nothing is changed then)."""
    context = tls_context()
    if ca_file or ca_dir:
        try:
            context.load_verify_locations(ca_file or None, ca_dir or None)
        except (OSError, ssl.SSLError) as exc:
            where = " and ".join(filter(None, (ca_file, ca_dir)))
            return f"cannot read the trusted CAs in {where}: {exc}"
    if insecure:
        context.check_hostname = False  # (before the mode: a checked name needs a cert)
        context.verify_mode = ssl.CERT_NONE
    else:
        context.verify_mode = ssl.CERT_REQUIRED
        context.check_hostname = True
    return None
