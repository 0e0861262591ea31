"""What turns a server away from going on with an answer, known without asking it: a
function of the client's request, the answer so far and what the server said of itself.

Each is decided twice: before a pressure or asked handoff cuts a healthy answer
(answer/decide.py: where every server below refuses, the answer stays where it is), and
at the moment of use, on the answer as it stands then (NextLeg.continuation). What only
the server can tell (its rendering, its tokens) is found by building the continuation
(NextLeg.asked_refusal).
"""

from __future__ import annotations

from typing import Any

from addon.formats.continuers import OWN_RENDERING, TRAILING_MESSAGE
from addon.formats.transcript import Transcript
from addon.handoff import sampling, vllm, vocabids
from addon.servers import vllm_routes
from addon.servers.directory import ServerDirectory
from addon.servers.info import ServerInfo
from addon.servers.upstream import Upstream

LLAMA_SERVER_WAYS = (TRAILING_MESSAGE.name, OWN_RENDERING.name)
UNPROVEN = {"behaviour": "proven by its behaviour only", "declared": "declared, not proven"}


def parses(info: ServerInfo | None) -> bool:
    """Whether the server reads a prompt of ids with its own chat parsers (vLLM's own
    routes): reasoning and tool calls then go on there from the truth itself."""
    return info is not None and info.own_routes == vllm_routes.ON


def unproven(info: ServerInfo | None) -> str | None:
    """How a server is known to continue where its engine cannot say what it reads
    ("behaviour" or "declared"); None where it can."""
    proof = info.proof if info is not None else None
    return proof if proof in UNPROVEN else None


def refusal(
    servers: ServerDirectory,
    body: dict[str, Any],
    transcript: Transcript,
    upstream: Upstream,
    from_ids: bool,
) -> str | None:
    """Why `upstream` may not go on with the answer to `body` as `transcript` holds it;
    `from_ids`: its continuation would go on from the answer's token ids."""
    why = _unproven_for_reasoning(servers.get(upstream), transcript, upstream.url)
    if why is not None:
        return why
    first = Upstream(transcript.legs[0].server) if transcript.legs else None
    if first is None:
        return None  # nothing was written yet: any server answers from the start
    same = servers.same_tokenizer(first, upstream)
    if (why := vocabids.foreign(body, first.url, upstream.url, same)) is not None:
        return why
    first_engine = servers.get(first).engine
    why = sampling.sampled_otherwise(servers, body, transcript, upstream)
    if why is None and first_engine == vllm.ENGINE and not from_ids:
        why = _parsed_only(body, transcript)
    return f"{upstream.url}: {why}" if why is not None else None


def _unproven_for_reasoning(info: ServerInfo, transcript: Transcript, url: str) -> str | None:
    """Why the server may not go on with this answer's reasoning: its way of continuing
    was proven on a plain answer, and only llama-server's chat route is known to go on
    with a reasoning one (tests/test_reasoning.py), checked for each answer."""
    way = info.continues_by
    if not transcript.reasoning or way is None:
        return None
    if (proof := unproven(info)) is not None:
        return (
            f"{url} is {UNPROVEN[proof]}, on plain answers: where this answer's reasoning "
            "goes there is not known"
        )
    if way in LLAMA_SERVER_WAYS or parses(info):
        return None
    return (
        f"{url} continues by {way}, seen to go on with plain answers only: where this "
        "answer's reasoning goes there is not known"
    )


def _parsed_only(body: dict[str, Any], transcript: Transcript) -> str | None:
    """Why a vLLM primary's answer, which its parsers may have changed (tools were
    offered, or it reasoned: a marker hidden, whitespace trimmed), cannot go on on a
    server that does not go on from its ids: what its model wrote is known only so."""
    if transcript.raw_output() is not None:
        return None  # known byte for byte all the same
    if body.get("tools"):
        parser = "tool-call parser (tools were offered)"
    elif transcript.reasoning:
        parser = "reasoning parser"
    else:
        return None
    return (
        f"the answer so far is known only as vLLM's {parser} showed it, and what its "
        "model wrote (its token ids) does not go on here"
    )
