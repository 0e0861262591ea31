"""A mitmproxy contentview ("Spillover SSE") that makes a stitched chat stream readable.

One line per event: a running token number and the quoted delta text (its field named when
it is not plain content), the finish reason, usage and errors on lines of their own, and
every spillover handoff comment as a separator. Anything it cannot parse is shown raw.
"""

from __future__ import annotations

import json
from typing import Any

from mitmproxy import contentviews
from mitmproxy.contentviews import Metadata

from addon.formats.shape import loads

NAME = "Spillover SSE"
PRIORITY_SPLICED = 2.0  # above every built-in view for the addon's own flows
PRIORITY_OTHER_SSE = 0.05  # selectable for any event stream, but "raw" (0.1) stays the default
RULE = "═" * 8
PAD = " " * 7


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


class SpilloverSSE(contentviews.Contentview):
    @property
    def name(self) -> str:
        return NAME

    def prettify(self, data: bytes, metadata: Metadata) -> str:
        text = data.decode("utf-8", "replace").replace("\r\n", "\n").replace("\r", "\n")
        out: list[str] = []
        tokens = 0
        for event in text.split("\n\n"):
            payload: list[str] = []
            for line in event.split("\n"):
                if line.startswith(":"):
                    note = line[1:].strip()
                    if note.startswith("spillover:"):  # a handoff: the rule, then the details
                        head, paren, rest = note.removeprefix("spillover:").strip().partition(" (")
                        out += [*([""] if out else []), f"{RULE} {head} {RULE}"]
                        out += [f"{PAD}({rest}", ""] if paren else [""]
                    elif note:
                        out.append(f"{PAD}: {note}")
                elif line.startswith("data:"):
                    payload.append(line[6:] if line[5:6] == " " else line[5:])
                elif line.strip():
                    out.append(f"{PAD}{line}")
            if payload:
                try:
                    tokens = self._data("\n".join(payload), tokens, out)
                except Exception:  # a shape nobody expected: show it as it came
                    out.append(PAD + "\n".join(payload))
        return "".join(line + "\n" for line in out)

    def _data(self, raw: str, tokens: int, out: list[str]) -> int:
        """Append the lines for one `data:` payload; returns the running token count."""
        if raw.strip() == "[DONE]":
            out.append(f"{PAD}[DONE]")
            return tokens
        try:
            chunk = loads(raw)
        except ValueError:
            chunk = None
        if not isinstance(chunk, dict):
            out.append(f"{PAD}{raw}")
            return tokens
        if chunk.get("error") is not None:
            error = chunk["error"]
            if isinstance(error, dict):
                code, kind = error.get("code", ""), error.get("type", "")
                out.append(f"{PAD}✖ ERROR {code} {kind}: {error.get('message', _dumps(error))}")
            else:
                out.append(f"{PAD}✖ ERROR: {_dumps(error)}")
            return tokens
        choices = chunk.get("choices")
        shown, role, parts = False, None, dict[str, Any]()
        for choice in choices if isinstance(choices, list) else []:
            if not isinstance(choice, dict):
                continue
            tag = f"[{choice['index']}] " if choice.get("index", 0) else ""
            delta = choice.get("delta")
            parts = dict(delta) if isinstance(delta, dict) else {}
            role = parts.get("role") or role
            if isinstance(choice.get("text"), str):  # text completions
                parts["content"] = choice["text"]
            for field, label in (("reasoning_content", "reasoning "), ("content", "")):
                if isinstance(parts.get(field), str) and parts[field]:
                    tokens += 1
                    out.append(f"{tokens:>5}  {tag}{label}{_dumps(parts[field])}")
                    shown = True
            if parts.get("tool_calls"):
                tokens += 1
                out.append(f"{tokens:>5}  {tag}tool_calls {_dumps(parts['tool_calls'])}")
                shown = True
            if choice.get("finish_reason"):
                out.append(f"{PAD}{tag}finish: {choice['finish_reason']}")
                shown = True
        if chunk.get("usage"):
            out.append(f"{PAD}usage: {_dumps(chunk['usage'])}")
            shown = True
        if not shown:
            opening = role and not any(v for k, v in parts.items() if k != "role")
            out.append(f"{PAD}(role {role})" if opening else f"{PAD}{raw}")
        return tokens

    def render_priority(self, data: bytes, metadata: Metadata) -> float:
        if not data or metadata.content_type != "text/event-stream":
            return 0
        spliced = "spillover" in (getattr(metadata.flow, "metadata", None) or {})
        return PRIORITY_SPLICED if spliced else PRIORITY_OTHER_SSE


view = SpilloverSSE()


def register() -> None:
    """Add the view to mitmproxy's contentviews, once."""
    if NAME.lower() not in contentviews.registry:
        contentviews.add(view)
