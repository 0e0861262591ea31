"""The other workers of one proxy (`spillover run --workers N`: N whole proxies behind
HAProxy, scripts/workers/pool.py). A control request any worker gets is answered for all of
them: an asked-for handoff, a drain or an undrain is passed on to the others, and the
metrics are summed. What is passed on carries FANNED and goes no further.

Behind HAProxy every client connects from loopback; HAProxy names the client's own
address in PEER (replacing any the client sent), and a worker with siblings reads the
client's address from it."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from addon.servers.tls import tls_context

FANNED = "x-spillover-fanned"
PEER = "x-spillover-peer"
TIMEOUT_S = 5.0
# Families every worker reads alike (the same cards, its own view of the servers): one
# worker's, not their sum.
SAME_IN_EACH = ("spillover_card_", "spillover_server_state", "spillover_server_health_slow")
log = logging.getLogger(__name__)


def add_sibling_options(loader: Any) -> None:
    loader.add_option(
        "spillover_siblings", str, "",
        "Comma-separated control URLs of this proxy's other workers (set by `spillover "
        "run --workers`): control requests and metrics are answered for all of them.",
    )  # fmt: skip


class Siblings:
    def __init__(self) -> None:
        self.urls: list[str] = []

    def configure(self, option: str) -> None:
        self.urls = [url.strip().rstrip("/") for url in option.split(",") if url.strip()]

    async def post(self, route: str, content: bytes) -> list[dict[str, Any]]:
        """POST a control request to every sibling; their answers (those that answered)."""
        replies = await self._each("POST", route, content)
        return [reply.json() for reply in replies if reply.status_code == 200]

    async def get(self, route: str) -> list[Any]:
        """GET a control route of every sibling: JSON, or the bytes of anything else."""
        replies = await self._each("GET", route, b"")
        return [
            reply.json()
            if reply.headers.get("content-type") == "application/json"
            else reply.content
            for reply in replies
            if reply.status_code == 200
        ]

    async def _each(self, method: str, route: str, content: bytes) -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=TIMEOUT_S, verify=tls_context()) as client:
            asked = [
                client.request(
                    method, f"{url}/spillover/{route}", content=content, headers={FANNED: "1"}
                )
                for url in self.urls
            ]
            replies = await asyncio.gather(*asked, return_exceptions=True)
        answered = []
        for url, reply in zip(self.urls, replies, strict=True):
            if isinstance(reply, BaseException):
                log.info("worker %s did not answer /spillover/%s: %r", url, route, reply)
            else:
                answered.append(reply)
        return answered


def summed(own: bytes, others: list[str]) -> bytes:
    """One exposition for all workers: counters, histograms and live answers summed;
    cards and server states as this worker reads them; creation times its own."""
    families = list(text_string_to_metric_families(own.decode()))
    known = {family.name: family for family in families if not _own_only(family.name)}
    samples = {(s.name, _labels(s)): (family, i) for family in known.values()
               for i, s in enumerate(family.samples)}  # fmt: skip
    for text in others:
        for theirs in text_string_to_metric_families(text):
            if (family := known.get(theirs.name)) is None:
                continue
            for sample in theirs.samples:
                key = (sample.name, _labels(sample))
                if key in samples:
                    held, i = samples[key]
                    held.samples[i] = held.samples[i]._replace(
                        value=held.samples[i].value + sample.value
                    )
                else:  # a sample only other workers have (a kind of handoff seen there)
                    samples[key] = (family, len(family.samples))
                    family.samples.append(sample)
    registry = CollectorRegistry()
    registry.register(_Parsed(families))
    return generate_latest(registry)


def _labels(sample: Any) -> tuple:
    return tuple(sorted(sample.labels.items()))


def _own_only(name: str) -> bool:
    return name.endswith("_created") or name.startswith(SAME_IN_EACH)


class _Parsed:
    def __init__(self, families: list[Any]) -> None:
        self._families = families

    def collect(self) -> list[Any]:
        return self._families
