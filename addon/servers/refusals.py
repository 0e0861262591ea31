"""What a server's refusal before the first byte means for the answer: whether another
server may take the request as it is, and for how long the refusing one is busy.

- Busy (408, 429, 503): the request is fine, the server cannot take it now. Another
  server with room takes it; the refusing one gets no new request for its `Retry-After`
  (seconds or an HTTP date), or a few seconds where it says none.
- Out of context: the prompt does not fit the server's context. Each engine says so in
  its own words (OpenAI's `context_length_exceeded`, llama-server's
  `exceed_context_size_error`, vLLM's "maximum context length ... max_model_len"): a
  server whose context is larger, or not known, may take it.

Anything else refused before the first byte is the request's own fault, and the client
gets the server's answer as it is.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from email.utils import parsedate_to_datetime

BUSY = frozenset({408, 429, 503})
BUSY_WITHOUT_RETRY_AFTER_S = 5.0
LONGEST_BUSY_S = 3600.0
OUT_OF_CONTEXT = re.compile(
    rb"context_length_exceeded|exceed_context_size_error|maximum context length"
    rb"|max_model_len|exceeds the available context size",
    re.IGNORECASE,
)


def retry_after(headers: Sequence[tuple[bytes, bytes]], now: float | None = None) -> float | None:
    """The seconds a `Retry-After` header asks for (None: no usable header)."""
    for name, value in headers:
        if name.lower() != b"retry-after":
            continue
        text = value.decode("latin-1").strip()
        if text.isdigit():
            return min(float(text), LONGEST_BUSY_S)
        try:
            when = parsedate_to_datetime(text).timestamp()
        except (TypeError, ValueError, IndexError):
            return None
        wall = time.time() if now is None else now
        return min(max(0.0, when - wall), LONGEST_BUSY_S)
    return None


def out_of_context(status: int, body: bytes) -> bool:
    """Whether a refusal says the prompt does not fit the server's context."""
    return status in (400, 413) and OUT_OF_CONTEXT.search(body[:65536]) is not None
