"""Remote cards, read from the fleet's Prometheus: one query per interval, on a thread of
its own, so that a slow or dead Prometheus never delays the local readings the monitor
takes between its answers.

Each remote card's reading carries the time it was scraped and how long it stays fresh:
its scrape interval (from the spacing of its samples) and a half for jitter, plus the
query interval and the query's own time. Past that it is stale, and with Prometheus not
answering every remote card is reported as failing at once: either way the card is
unknown, never fine. Ages are told by the two clocks, Prometheus's and ours: they must
agree (NTP) to within a fraction of a scrape interval.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from watchers import gates
from watchers.exporters import RemoteCard, cards_of, query, series_of
from watchers.reading import CardFailure, Reading

log = logging.getLogger(__name__)
FIRST_LOOKBACK_S = 60.0  # until the scrape intervals are known
JITTER_SHARE = 0.5


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str  # =, !=, =~, !~
    value: str

    def holds(self, labels: Mapping[str, str]) -> bool:
        have = labels.get(self.label, "")
        if self.op in ("=", "!="):
            return (have == self.value) == (self.op == "=")
        return bool(re.fullmatch(self.value, have)) == (self.op == "=~")


_MATCHER = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"\s*')
_ENTRY = re.compile(r"([^\s,{}]+?)=\{([^{}]*)\}")
_MATCHERS = re.compile(r'(?:[^,"]|"(?:[^"\\]|\\.)*")+')


def parse_selectors(text: str) -> dict[str, list[Matcher]]:
    """ "URL={label="v",...} URL={...}" -> {URL: matchers}; ValueError where malformed."""
    found: dict[str, list[Matcher]] = {}
    if _ENTRY.sub("", text).strip(" ,\t\n"):
        raise ValueError(f'spillover_remote_cards: {text!r} is not URL={{label="value",...}} ...')
    for entry in _ENTRY.finditer(text):
        matchers = []
        for part in filter(str.strip, _MATCHERS.findall(entry[2])):
            matcher = _MATCHER.fullmatch(part)
            if matcher is None:
                raise ValueError(f'spillover_remote_cards: {part.strip()!r} is not label="value"')
            op, value = matcher[2], matcher[3].replace('\\"', '"')
            if op in ("=~", "!~"):
                try:  # a bad pattern is a clear error now, not a miss later
                    re.compile(value)
                except re.error as exc:
                    raise ValueError(f"spillover_remote_cards: {value!r}: {exc}") from None
            matchers.append(Matcher(matcher[1], op, value))
        if (url := entry[1].rstrip("/")) in found:
            raise ValueError(f"spillover_remote_cards: {url} is named twice: name it once")
        found[url] = matchers
    return found


class PrometheusSource:
    """A memory source whose cards are on other hosts (see the module's docstring)."""

    name = "prometheus"

    def __init__(
        self,
        url: str,
        token: str | None = None,
        interval_s: float = 1.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)  # what is shown: without a user:password in the URL
        self.shown = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
        self.interval_s = interval_s
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.Client(
            headers=headers, timeout=max(interval_s, 0.5), transport=transport
        )
        # Scrape times (Prometheus's clock) as monotonic times, by one fixed offset: a
        # sample read again is the same reading (a step needs a second scrape to confirm).
        self._offset = time.monotonic() - time.time()
        self.cards: dict[str, RemoteCard] = {}
        self.error: str | None = None  # why the last query got no answer
        self.answered_at: float | None = None  # time.monotonic() of the last answer
        self.query_s = 0.0
        self.queries = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spillover-prometheus", daemon=True)

    def start(self) -> PrometheusSource:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self._client.timeout.read or 2)
        self._client.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.poll()
            self._stop.wait(max(self.interval_s - (time.monotonic() - started), 0.0))

    def poll(self) -> None:
        """Ask Prometheus once; keep what it says, or why it said nothing."""
        started = time.monotonic()
        try:
            response = self._client.get(
                f"{self.url}/api/v1/query", params={"query": f"{query()}[{self._lookback()}s]"}
            )
            answer = response.raise_for_status().json()
            if answer.get("status") != "success":
                raise ValueError(f"{answer.get('errorType')}: {answer.get('error')}")
            cards = cards_of(series_of(answer["data"]["result"]))
        except (httpx.HTTPError, ValueError, KeyError, TypeError, IndexError) as exc:
            with self._lock:
                if self.error is None:
                    log.warning("prometheus %s: %s: remote cards are unknown", self.shown, exc)
                self.error = f"{type(exc).__name__}: {exc}"
            return
        with self._lock:
            if self.error is not None:
                log.info("prometheus %s answers again", self.shown)
            self.cards, self.error = cards, None
            self.query_s = time.monotonic() - started
            self.answered_at = time.monotonic()
            self.queries += 1

    def _lookback(self) -> int:
        spacings = [c.spacing_s for c in self.cards.values() if c.spacing_s]
        if not spacings:
            return int(FIRST_LOOKBACK_S)
        return max(int(2.5 * max(spacings)) + 1, int(3 * self.interval_s) + 1)

    def fresh_for(self, card: RemoteCard) -> float:
        scrape = card.spacing_s or self.interval_s
        return scrape * (1 + JITTER_SHARE) + self.interval_s + self.query_s

    def read(self) -> list[Reading | CardFailure]:
        with self._lock:
            cards, error = dict(self.cards), self.error
        if error is not None:
            return [CardFailure(card, f"prometheus {self.shown}: {error}") for card in cards]
        return [
            Reading(
                card.card,
                card.used_mib,
                card.total_mib,
                card.time + self._offset,
                fresh_s=self.fresh_for(card),
            )
            for card in cards.values()
        ]

    def cards_on(self, server: str, matchers: list[Matcher] | None) -> set[str]:
        """The remote cards of a server: those its selector matches, else those whose
        host labels name its URL's host."""
        host = urlsplit(server).hostname
        with self._lock:
            cards = list(self.cards.values())
        if matchers is not None:
            return {c.card for c in cards if all(m.holds(c.labels) for m in matchers)}
        return {c.card for c in cards if host in c.hosts}

    def status(self) -> dict:
        with self._lock:
            return {
                "url": self.shown,
                "error": self.error,
                "queries": self.queries,
                "query_ms": round(self.query_s * 1000, 1),
                "answered_s_ago": None
                if self.answered_at is None
                else round(time.monotonic() - self.answered_at, 1),
                "cards": {
                    c.card: {
                        "exporter": c.exporter,
                        "hosts": sorted(c.hosts),
                        "scraped_every_s": c.spacing_s,
                        "fresh_for_s": round(self.fresh_for(c), 2),
                    }
                    for c in self.cards.values()
                },
            }


def remote_mapping(
    source: PrometheusSource, server: str, matchers: list[Matcher] | None
) -> gates.Mapping:
    """How a server on another host is mapped to the cards Prometheus shows."""
    cards = frozenset(source.cards_on(server, matchers))
    if matchers is not None:
        which = (
            "spillover_remote_cards {"
            + ",".join(f'{m.label}{m.op}"{m.value}"' for m in matchers)
            + "}"
        )
    else:
        which = f"series whose host labels name {urlsplit(server).hostname}"
    if not cards:
        return gates.Mapping(cards, gates.PROMETHEUS, f"no card in {source.shown} matches {which}")
    return gates.Mapping(cards, gates.PROMETHEUS, f"{which}: {', '.join(sorted(cards))}")
