"""A server's own clients, decoding beside what the addon sends there: each answer must
have all its tokens, each the one the same request made alone gets.

Each client asks llama-server's native `/completion` directly (not through the proxy),
greedy, with `ignore_eos` (so the length is known) and the CANDIDATES best tokens of each
step. llama-server is not batch-invariant: decoded beside other requests, a step whose
best candidates were nearly tied may come out as another of them, after which the rest
cannot be compared. Such a flip is told from a changed answer by the step itself: the
token taken is one of alone's candidates within twice TIE of its best, and every
candidate both lists hold is within TIE of the probability it had alone. An answer
computed from a wrong state (what a pinned request of the addon's into a busy slot did:
see addon/handoff/shadow.py) has other probabilities there, or ends early.
"""

from __future__ import annotations

from typing import Any

import httpx

# Log-probability: how far a candidate moves when decoded in another batch (seen: up to
# 0.17, in 4-way batches of direct requests, no proxy at all). A flip moves the two
# candidates toward each other, so alone's gap between them can be up to twice that
# (seen: 0.252, ' under' -2.384 over ' card' -2.636 at a victim's 6th token).
TIE = 0.25
CANDIDATES = 5


def victim_body(index: int, tokens: int) -> dict[str, Any]:
    words = " ".join(f"lake{(index * 7 + i) % 40}" for i in range(60))
    return {
        "prompt": f"A list of places: {words}. And then",
        "n_predict": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "cache_prompt": False,
        "n_probs": CANDIDATES,
    }


def changed(answer: dict[str, Any], alone: dict[str, Any], tokens: int) -> str | None:
    """How `answer` differs from `alone` (the same request made by itself) beyond a
    near-tie, or None."""
    if answer.get("tokens_predicted") != tokens:
        return f"{answer.get('tokens_predicted')} of {tokens} tokens ({answer.get('stop_type')})"
    got = answer.get("completion_probabilities") or []
    steps = alone["completion_probabilities"]
    for index, (mine, step) in enumerate(zip(got, steps, strict=False)):
        if mine["token"] == step["token"]:
            continue
        if _near_tie(mine, step):
            return None  # a tie taken another way: the rest cannot be compared
        return f"token {index}: {_candidates(mine)}; alone {_candidates(step)}"
    if len(got) != len(steps):
        return f"{len(got)} token probabilities, alone {len(steps)}"
    return None


def _near_tie(mine: dict[str, Any], alone: dict[str, Any]) -> bool:
    """Whether the step `mine` took another of `alone`'s nearly tied best candidates,
    from nearly the same probabilities (each within TIE of alone's, so the two were
    within twice that of each other)."""
    theirs = {t["token"]: t["logprob"] for t in alone.get("top_logprobs") or ()}
    ours = {t["token"]: t["logprob"] for t in mine.get("top_logprobs") or ()}
    if mine["token"] not in theirs or max(theirs.values()) - theirs[mine["token"]] >= 2 * TIE:
        return False
    return all(abs(theirs[t] - ours[t]) < TIE for t in theirs.keys() & ours.keys())


def _candidates(step: dict[str, Any]) -> str:
    top = step.get("top_logprobs") or []
    return ", ".join(f"{t['token']!r} {t['logprob']:.3f}" for t in top[:3]) or repr(step["token"])


async def ask(client: httpx.AsyncClient, server: str, index: int, tokens: int) -> dict:
    reply = await client.post(f"{server}/completion", json=victim_body(index, tokens))
    return reply.raise_for_status().json()
