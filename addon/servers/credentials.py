"""Which credentials go to which server.

The client's own credentials (`Authorization`; `X-Api-Key`, which Anthropic clients send
and llama-server takes; `Api-Key`; `Cookie`) go to the server it addressed, the primary,
exactly as without the proxy, and to a fallback only where the owner says so
(`spillover_forward_credentials`). Each server may have a key of its own
(`spillover_server_keys`): the addon uses it for its own questions, and for a fallback's
legs once the primary has accepted the client's request, so a client that the primary
would refuse is never let in with the owner's key. The flows the addon records of its own
(legs, questions) never hold any of them; the client's own flow is recorded by mitmproxy
as the client sent it, its credentials included.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

from mitmproxy import exceptions

Header = tuple[bytes, bytes]
CLIENT_CREDENTIALS = {
    b"authorization", b"x-api-key", b"api-key", b"cookie", b"proxy-authorization",
}  # fmt: skip
REDACTED = b"(redacted)"
EVERY_FALLBACK = "all"  # spillover_forward_credentials's word for every fallback


def read_secret(value: str) -> str:
    """An option's secret: the value itself, or a file's first line for `@/path`, so the
    secret need not appear on a command line (where `ps` shows it)."""
    if not value.startswith("@"):
        return value
    try:
        lines = Path(value[1:]).read_text().splitlines()
    except OSError as exc:
        raise exceptions.OptionsError(f"cannot read secret from {value[1:]}: {exc}") from None
    return lines[0].strip() if lines else ""


def url_pairs(option: str, name: str, what: str) -> dict[str, str]:
    """`URL=VALUE,...`, the value of option `name`, as {URL: VALUE} (`what`: the value's
    name in the error). A URL has no `=`; a value may (a base64 key does)."""
    pairs = {}
    for item in filter(None, (part.strip() for part in option.split(","))):
        url, sep, value = item.partition("=")
        if not sep or not url or not value:
            raise exceptions.OptionsError(f"{name}: expected URL={what}, got {item!r}")
        url = url.strip().rstrip("/")
        if url in pairs:
            raise exceptions.OptionsError(f"{name}: {url} is named twice: name it once")
        pairs[url] = value.strip()
    return pairs


def forwarded(option: str) -> dict[str, bool]:
    """spillover_forward_credentials's URLs as {URL: True} (`all` is none of them)."""
    names = (part.strip().rstrip("/") for part in option.split(","))
    return {name: True for name in names if name and name != EVERY_FALLBACK}


def forwards_to_all(option: str) -> bool:
    return EVERY_FALLBACK in (part.strip() for part in option.split(","))


class Credentials:
    def __init__(
        self,
        keys: dict[str, str] | None = None,
        forward: Collection[str] = (),
        forward_all: bool = False,
    ) -> None:
        """`keys` and `forward` name servers by their URLs as configured."""
        self.keys = keys or {}
        self.forward_all = forward_all
        self.forward = set(forward)

    def question_headers(self, url: str) -> dict[str, str]:
        """Headers for the addon's own questions to a server."""
        key = self.keys.get(url)
        return {"authorization": f"Bearer {key}"} if key else {}

    def may_start_on(self, url: str, primary: str, locked: frozenset[str]) -> bool:
        """Whether a new request may start on fallback `url` without the primary having
        seen it: not when the primary needs a key (it has one here, or it is in `locked`,
        the servers that turned the addon's questions away for want of one: only it can
        judge the client's), nor when the fallback would need a key that the client's
        request does not bring (its own is used only for clients the primary accepted)."""
        if primary in locked or self.keys.get(primary):
            return False
        forwarded = self.forward_all or url in self.forward
        return forwarded or not (self.keys.get(url) or url in locked)

    def admits(self, url: str, primary: str, locked: frozenset[str], accepted: bool) -> bool:
        """Whether a client may be served on `url` now: anywhere once the primary has let
        it in (`accepted`); before that, where `may_start_on` allows, so that a dead or
        busy primary never opens the fallbacks to strangers."""
        return accepted or url == primary or self.may_start_on(url, primary, locked)

    def leg_headers(
        self, url: str, client: Sequence[Header], primary: bool, accepted: bool
    ) -> list[Header]:
        """The client's headers as a leg to `url` should carry them. `accepted`: the
        primary has answered this request (so the client is one it lets in)."""
        if primary or self.forward_all or url in self.forward:
            return list(client)
        headers = [(k, v) for k, v in client if k.lower() not in CLIENT_CREDENTIALS]
        if accepted and (key := self.keys.get(url)):
            headers.append((b"authorization", f"Bearer {key}".encode()))
        return headers


def redacted(headers: Sequence[Header]) -> list[Header]:
    """Headers fit for a recording: credentials' values replaced."""
    return [(k, REDACTED if k.lower() in CLIENT_CREDENTIALS else v) for k, v in headers]
