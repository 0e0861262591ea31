"""A server's own clients, decoding beside what the addon sends there: each answer must
have all its tokens, each the one the same request made alone gets.

Each client asks llama-server's native `/completion` directly (not through the proxy),
greedy, with `ignore_eos` (so the length is known) and the two best candidates of each
step. llama-server is not batch-invariant: decoded beside other requests, a token whose
two best candidates were tied (log-probabilities within TIE) may come out as the
runner-up, after which the rest cannot be compared. Anything else is another answer
changed: what a pinned request of the addon's into a busy slot did (see addon/shadow.py).
"""

from __future__ import annotations

from typing import Any

import httpx

TIE = 0.1  # flips seen with gaps up to 0.06


def victim_body(index: int, tokens: int) -> dict[str, Any]:
    words = " ".join(f"lake{(index * 7 + i) % 40}" for i in range(60))
    return {
        "prompt": f"A list of places: {words}. And then",
        "n_predict": tokens,
        "ignore_eos": True,
        "temperature": 0,
        "cache_prompt": False,
        "n_probs": 2,
    }


def changed(answer: dict[str, Any], alone: dict[str, Any], tokens: int) -> str | None:
    """How `answer` differs from `alone` (the same request made by itself) beyond a tied
    step, or None."""
    if answer.get("tokens_predicted") != tokens:
        return f"{answer.get('tokens_predicted')} of {tokens} tokens ({answer.get('stop_type')})"
    got = [step["token"] for step in answer.get("completion_probabilities") or ()]
    steps = alone["completion_probabilities"]
    for index, (token, step) in enumerate(zip(got, steps, strict=False)):
        if token == step["token"]:
            continue
        best, second = step["top_logprobs"][:2]
        gap = best["logprob"] - second["logprob"]
        if gap < TIE and token == second["token"]:
            return None  # a tie taken the other way: the rest cannot be compared
        return f"token {index}: {token!r}, alone {best['token']!r} (gap {gap:.3f})"
    if len(got) != len(steps):
        return f"{len(got)} token probabilities, alone {len(steps)}"
    return None


async def ask(client: httpx.AsyncClient, server: str, index: int, tokens: int) -> dict:
    reply = await client.post(f"{server}/completion", json=victim_body(index, tokens))
    return reply.raise_for_status().json()
