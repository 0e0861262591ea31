"""Clients change nothing: the kernel sends their connections for the primary to the proxy.

With `spillover_redirect` in mitmproxy's transparent mode, the proxy adds nftables rules
that redirect TCP connections for the primary's address and port to its own listening
port (nftables.py): connections from other machines, containers and namespaces, and
local ones of every user but the proxy's own (whose connections to the primary are the
proxy's). mitmproxy reads each connection's original destination, which is the primary.
The rules are added once the proxy listens and exist as long as its process: they go at
stop, and the kernel drops them if the process dies any other way. Rules that cannot be
added stop the proxy at start, with the reason, and leave nothing behind.
"""

from __future__ import annotations

import asyncio
import logging

from mitmproxy import ctx
from mitmproxy.proxy.mode_specs import ProxyMode, TransparentMode

from addon.surface.nftables import Nftables, NftablesError, redirect_to

log = logging.getLogger(__name__)
LISTEN_WAIT_S = 10


class KernelRedirect:
    def __init__(self) -> None:
        self._nft: Nftables | None = None

    def load(self, loader) -> None:
        loader.add_option(
            "spillover_redirect", bool, False,
            "In mitmproxy's transparent mode, have the kernel send every connection for "
            "spillover_primary's address and port to this proxy (nftables rules that "
            "live as long as this process; the proxy's own user is exempt), so clients "
            "keep the server's URL. Needs CAP_NET_ADMIN; `spillover doctor` says whether "
            "this machine can.",
        )  # fmt: skip

    async def running(self) -> None:
        if not ctx.options.spillover_redirect:
            return
        try:
            if not ctx.options.spillover_primary:
                raise ValueError("spillover_redirect needs spillover_primary (the server's URL)")
            redirect = redirect_to(ctx.options.spillover_primary, await _transparent_port())
            self._nft = Nftables()
            self._nft.run(redirect.ruleset())
        except (NftablesError, ValueError, OSError) as exc:
            self.done()
            log.error("spillover: no redirect, so not started: %s", exc)
            ctx.master.shutdown()
            return
        log.info(
            "spillover: the kernel now sends connections for %s:%d to this proxy (port %d)",
            redirect.address, redirect.port, redirect.to_port,
        )  # fmt: skip

    def done(self) -> None:
        if self._nft is not None:
            self._nft.close()  # the owner table goes with the context
            self._nft = None


async def _transparent_port() -> int:
    """The port this proxy's transparent mode listens on, once it does (mitmproxy starts
    its servers in the background)."""
    if not any(isinstance(ProxyMode.parse(m), TransparentMode) for m in ctx.options.mode):
        raise ValueError("spillover_redirect needs mitmproxy's transparent mode")
    for _ in range(LISTEN_WAIT_S * 100):
        for server in ctx.master.addons.get("proxyserver").servers:
            if isinstance(server.mode, TransparentMode) and server.listen_addrs:
                return server.listen_addrs[0][1]
        await asyncio.sleep(0.01)
    raise ValueError(f"the transparent mode is not listening after {LISTEN_WAIT_S} s")
