"""How far a server has got, as its Prometheus `/metrics` counts it: the tokens it has read
and written for every request (vLLM's `vllm:prompt_tokens_total` and
`vllm:generation_tokens_total`, llama-server's `llamacpp:prompt_tokens_total` and
`llamacpp:tokens_predicted_total`), and the requests it runs and keeps waiting. Counted
twice a moment apart, the tokens tell a server that computes for other requests while
one waits in its queue from a wedged one; its gauges alone do not (a wedged vLLM's API
server still says it runs what it ran)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# Counter families (as the parser names them: without `_total`).
TOKENS = ("vllm:prompt_tokens", "vllm:generation_tokens")
TOKENS += ("llamacpp:prompt_tokens", "llamacpp:tokens_predicted")
RUNNING = ("vllm:num_requests_running", "llamacpp:requests_processing")
WAITING = ("vllm:num_requests_waiting", "llamacpp:requests_deferred")


@dataclass(frozen=True)
class Progress:
    tokens: float  # read and written so far, for every request
    running: float
    waiting: float

    def since(self, before: Progress, seconds: float) -> str | None:
        """What the server did since `before`, in words; None when it counted no token."""
        if self.tokens <= before.tokens:
            return None
        return (
            f"{self.tokens - before.tokens:,.0f} tokens read and written in {seconds:g} s, "
            f"{self.running:g} requests running, {self.waiting:g} waiting"
        )


def progress_of(text: str) -> Progress | None:
    """The counts in a `/metrics` text; None where it counts no tokens (not an engine's,
    or not Prometheus text)."""
    sums = {"tokens": 0.0, "running": 0.0, "waiting": 0.0}
    counted = False
    try:
        for family in text_string_to_metric_families(text):
            kind = (
                "tokens" if family.name in TOKENS and family.type == "counter"
                else "running" if family.name in RUNNING
                else "waiting" if family.name in WAITING
                else None
            )  # fmt: skip
            if kind is None:
                continue
            counted |= kind == "tokens"
            sums[kind] += sum(s.value for s in family.samples if not s.name.endswith("_created"))
    except ValueError:  # not Prometheus text
        return None
    return Progress(**sums) if counted else None
