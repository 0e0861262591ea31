"""vLLM's own pieces of its chat route, where it serves them: `/v1/chat/completions/render`
(its rendering of a chat request as token ids, with the sampling it resolved),
`/inference/v1/generate` (token ids in, token ids out) and
`/v1/chat/completions/derender` (its reasoning and tool-call parsers over those ids).
vLLM 0.32 and later have them behind `--enable-scale-out` (without it they answer 403);
older ones do not have them (404)."""

from __future__ import annotations

import httpx

from addon.servers.prompts import Ask

RENDER = "/v1/chat/completions/render"
GENERATE = "/inference/v1/generate"
DERENDER = "/v1/chat/completions/derender"
ON = "render, generate, derender"
OFF = "off (vLLM serves them with --enable-scale-out)"
ABSENT = "absent (a vLLM before 0.32)"


async def own_routes(ask: Ask, model: str | None) -> str:
    """Which of vLLM's own routes the server answers (ON, OFF, ABSENT, or what else it
    said): a render of a one-line chat, and the two other routes asked with an empty
    body, which a route that exists refuses as invalid (400 or 422), not as unknown."""
    chat = {"messages": [{"role": "user", "content": "hi"}], **({"model": model} if model else {})}
    try:
        rendered = await ask(RENDER, chat)
    except httpx.HTTPStatusError as exc:
        return _why(exc.response.status_code)
    if not isinstance(rendered, dict) or not rendered.get("token_ids"):
        return f"not used: {RENDER} answered without token ids"
    for path in (GENERATE, DERENDER):
        try:
            await ask(path, {})
        except httpx.HTTPStatusError as exc:
            if exc.response.status_code not in (400, 422):
                return f"not used: {path} answered HTTP {exc.response.status_code}"
    return ON


def _why(status: int) -> str:
    if status == 403:
        return OFF
    if status in (404, 405):
        return ABSENT
    return f"not used: {RENDER} answered HTTP {status}"
