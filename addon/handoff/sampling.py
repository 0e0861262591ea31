"""The rest of an answer sampled on the next server as the first server sampled what was
written. Each sampling field of the request is, for the next server's engine:

- carried under that engine's own name for the same sampler, in its terms (vLLM's
  `repetition_penalty` weighs every token of the prompt and answer: llama-server's
  `repeat_penalty` with `repeat_last_n` its whole context);
- counted from the cut: `min_tokens` lowered by the tokens written, as `max_tokens` is;
- neutral where the first engine did not read it (llama-server ignores vLLM's
  `repetition_penalty`, `min_tokens` and `bad_words`: the answer so far was sampled
  without them, and the rest must be too);
- or refused: a sampler the next engine lacks (llama.cpp's DRY, XTC, mirostat, dynamic
  temperature, top-n-sigma, typical; vLLM's `bad_words`, `stop_token_ids`), one whose
  state a new request starts over (vLLM's presence and frequency penalties count the
  tokens it generated itself, never the prompt; mirostat's running target), penalties
  over windows of other sizes (llama-cpp-python's is a server option), or any field but
  OpenAI's own where an engine is not known.

What each engine reads: llama.cpp's server schema (tools/server/server-schema.cpp: its
penalties count the prompt too, the sampler is fed the prompt's tokens), vLLM 0.32's
ChatCompletionRequest and SamplingParams, llama-cpp-python 0.3's server request types.
A field at a value that leaves its sampler off is written as the next engine leaves it off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from addon.formats.transcript import Transcript
from addon.servers.directory import ServerDirectory
from addon.servers.info import ServerInfo
from addon.servers.upstream import Upstream

LLAMA, VLLM, LLAMA_CPP_PYTHON = "llama-server", "vllm", "llama-cpp-python"
KNOWN = (LLAMA, VLLM, LLAMA_CPP_PYTHON)
# Each engine by what its requests read (a llama-server router reads llama-server's).
FAMILY = {engine: engine for engine in KNOWN} | {"llama-server router": LLAMA}
NAMED = {LLAMA: "llama-server", VLLM: "vLLM", LLAMA_CPP_PYTHON: "llama-cpp-python"}
SAME, COUNTED, RESTARTS = "same", "counted", "restarts"  # how a sampler fares across a cut
DROP = object()  # a field taken out of the continuation


@dataclass(frozen=True)
class Engine:
    """A server as sampling goes: its engine (None: not known, or not one of KNOWN) and
    its context per slot in tokens (None: not known)."""

    name: str | None
    context: int | None = None

    @classmethod
    def of(cls, engine: str | None, context: int | None = None) -> Engine:
        return cls(FAMILY.get(engine or ""), context)

    @classmethod
    def serving(cls, info: ServerInfo) -> Engine:
        """The engine a server said it is, with its context per slot."""
        return cls.of(info.engine, info.slot_context)

    @property
    def said(self) -> str:
        return NAMED.get(self.name or "", "a server whose engine is not known")


@dataclass(frozen=True)
class Sampler:
    what: str  # what it does, as the client is told
    reads: dict[str | None, str]  # engine (None: any, OpenAI's own) -> the field it reads
    off: tuple[Any, ...] = ()  # values that leave it off; a negative `off`: any negative
    carries: str = SAME

    def active(self, value: Any) -> bool:
        if value is None or value in self.off or value in ([], {}):
            return False
        negative = [o for o in self.off if isinstance(o, int | float) and o < 0]
        return not (negative and isinstance(value, int | float) and value < 0)

    @property
    def neutral(self) -> Any:
        """The value that leaves it off (DROP where none does)."""
        return self.off[0] if self.off else DROP


def _everywhere(what: str, name: str, off: tuple[Any, ...] = (), core: bool = True) -> Sampler:
    engines = (None, *KNOWN) if core else KNOWN
    return Sampler(what, {engine: name for engine in engines}, off)


WINDOWED = "on the last repeat_last_n tokens, prompt included"
SERVER_WINDOWED = "on the last tokens of its server's window (last_n_tokens_size)"
OWN = "counted over the tokens it generated itself, never the prompt"
# vLLM's repetition penalty; llama-server's where its window holds the whole context.
WHOLE_PENALTY = Sampler("a penalty on every token of the prompt and answer",
                        {VLLM: "repetition_penalty"}, (1, 1.0))  # fmt: skip
WINDOW_PENALTY = Sampler(f"a penalty {WINDOWED}", {LLAMA: "repeat_penalty"}, (1, 1.0))
SAMPLERS = [
    _everywhere("temperature", "temperature"),
    _everywhere("top-p", "top_p", (1, 1.0)),
    _everywhere("the seed", "seed"),  # said in the note where it starts over (record.py)
    _everywhere("a bias on tokens", "logit_bias"),
    _everywhere("top-k", "top_k", (0, -1), core=False),
    _everywhere("min-p", "min_p", (0, 0.0), core=False),
    Sampler("a least number of tokens", {VLLM: "min_tokens", LLAMA_CPP_PYTHON: "min_tokens"},
            (0,), COUNTED),
    Sampler("no end of sequence", {LLAMA: "ignore_eos", VLLM: "ignore_eos"}, (False,)),
    WHOLE_PENALTY,
    WINDOW_PENALTY,
    Sampler(f"a presence penalty {WINDOWED}", {LLAMA: "presence_penalty"}, (0, 0.0)),
    Sampler(f"a frequency penalty {WINDOWED}", {LLAMA: "frequency_penalty"}, (0, 0.0)),
    Sampler(f"a penalty {SERVER_WINDOWED}", {LLAMA_CPP_PYTHON: "repeat_penalty"}, (1, 1.0)),
    Sampler(f"a presence penalty {SERVER_WINDOWED}", {LLAMA_CPP_PYTHON: "presence_penalty"},
            (0, 0.0)),
    Sampler(f"a frequency penalty {SERVER_WINDOWED}", {LLAMA_CPP_PYTHON: "frequency_penalty"},
            (0, 0.0)),
    Sampler(f"a presence penalty {OWN}", {VLLM: "presence_penalty"}, (0, 0.0), RESTARTS),
    Sampler(f"a frequency penalty {OWN}", {VLLM: "frequency_penalty"}, (0, 0.0), RESTARTS),
    Sampler("words it may not write", {VLLM: "bad_words"}),
    Sampler("tokens that end the answer", {VLLM: "stop_token_ids"}),
    Sampler("the only tokens it may write", {VLLM: "allowed_token_ids"}),
    Sampler("the stop string kept in the text", {VLLM: "include_stop_str_in_output"}, (False,)),
    Sampler("an end where the answer repeats itself", {VLLM: "repetition_detection"},
            carries=RESTARTS),
    Sampler("its extensions' fields", {VLLM: "vllm_xargs"}, carries=RESTARTS),
    Sampler("a budget of reasoning tokens", {VLLM: "thinking_token_budget"}, carries=RESTARTS),
    Sampler("a budget of reasoning tokens", {LLAMA: "reasoning_budget_tokens"}, (-1,),
            RESTARTS),
    Sampler("mirostat (its running target starts over)", {LLAMA: "mirostat",
            LLAMA_CPP_PYTHON: "mirostat_mode"}, (0,), RESTARTS),
    Sampler("adaptive sampling (its running average starts over)", {LLAMA: "adaptive_target"},
            (-1,), RESTARTS),
    Sampler("DRY", {LLAMA: "dry_multiplier"}, (0, 0.0)),
    Sampler("XTC", {LLAMA: "xtc_probability"}, (0, 0.0)),
    Sampler("typical sampling", {LLAMA: "typical_p"}, (1, 1.0)),
    Sampler("dynamic temperature", {LLAMA: "dynatemp_range"}, (0, 0.0)),
    Sampler("top-n-sigma", {LLAMA: "top_n_sigma"}, (-1,)),
    Sampler("a least number of candidate tokens", {LLAMA: "min_keep"}, (0,)),
    Sampler("its own order of samplers", {LLAMA: "samplers"}),
]  # fmt: skip
# What each engine reads (None: an engine not known, taken to read OpenAI's own only).
READS: dict[str | None, dict[str, Sampler]] = {
    engine: {s.reads[engine]: s for s in SAMPLERS if engine in s.reads} for engine in (None, *KNOWN)
}
# Whether a field's value samples at all, whoever reads it (for an engine not known).
SOME = {name: sampler for reads in READS.values() for name, sampler in reads.items()}


def sampled_otherwise(
    servers: ServerDirectory | None,
    body: dict[str, Any],
    transcript: Transcript,
    upstream: Upstream,
) -> str | None:
    """Why `upstream` would not sample the rest of the answer to `body` as the server of
    its first leg sampled what `transcript` holds (`refusal`)."""
    if (engines := _engines(servers, transcript, upstream)) is None:
        return None
    written = transcript.text or transcript.reasoning_text  # where the cut is
    return refusal(body, transcript.produced, written, *engines)


def sampled_as_first(
    servers: ServerDirectory | None,
    original: dict[str, Any],
    built: dict[str, Any],
    transcript: Transcript,
    upstream: Upstream,
) -> dict[str, Any]:
    """`built`, the continuation for `upstream`, asking it to sample the rest as the server
    of the first leg sampled what was written (`carried`)."""
    if (engines := _engines(servers, transcript, upstream)) is None:
        return built
    return carried(original, built, transcript.produced, *engines)


def _engines(
    servers: ServerDirectory | None, transcript: Transcript, upstream: Upstream
) -> tuple[Engine, Engine] | None:
    if servers is None or not transcript.legs:
        return None
    first = Upstream(transcript.legs[0].server)
    return Engine.serving(servers.get(first)), Engine.serving(servers.get(upstream))


def refusal(
    body: dict[str, Any], produced: int, written: str, first: Engine, target: Engine
) -> str | None:
    """Why `target` would not sample the rest of the answer to `body` as `first` sampled
    the `produced` tokens written so far (`written`, its text); None where it would."""
    found = _changes(body, produced, written, first, target) if produced else None
    return found if isinstance(found, str) else None


def carried(
    original: dict[str, Any], built: dict[str, Any], produced: int, first: Engine, target: Engine
) -> dict[str, Any]:
    """`built`, the continuation of the answer to `original` for `target`, with the
    request's sampling in `target`'s terms; a generate request's (vLLM's
    `sampling_params`, which its render resolved from the original request) too. Where
    `refusal` refuses, or nothing was written yet, `built` as it is."""
    changes = _changes(original, produced, "", first, target) if produced else {}
    if isinstance(changes, str) or not changes:
        return built
    resolved = built.get("sampling_params")
    into = dict(resolved) if isinstance(resolved, dict) and "token_ids" in built else None
    out = dict(built) if into is None else into
    for name, value in changes.items():
        if value is DROP:
            out.pop(name, None)
        else:
            out[name] = value
    return out if into is None else {**built, "sampling_params": out}


def _changes(
    body: dict[str, Any], produced: int, written: str, first: Engine, target: Engine
) -> dict[str, Any] | str:
    """The fields to set (or DROP) for `target`, or why it cannot sample the rest so."""
    changes: dict[str, Any] = {}
    for name in sorted(set(body) & set(SOME)):
        value = body[name]
        sampler = READS[first.name].get(name)
        if sampler is None:
            if first.name is None and SOME[name].active(value):
                return f"the answer so far was written by {first.said}: how it read {name} is not"
            if (theirs := READS[target.name].get(name)) is not None:
                changes.setdefault(name, theirs.neutral)  # the first engine sampled without it
            continue
        if not sampler.active(value):
            changes |= _off_in_terms(sampler, name, value, target)
            continue
        if sampler.carries == RESTARTS:
            return f"{name} would start over on {target.said} ({first.said}'s: {sampler.what})"
        if sampler is WINDOW_PENALTY and _whole_window(body, first):
            sampler = WHOLE_PENALTY
        found = _in_terms(sampler, name, value, produced, written, target)
        if isinstance(found, str):
            return found
        changes |= found
    return changes


def _in_terms(
    sampler: Sampler, name: str, value: Any, produced: int, written: str, target: Engine
) -> dict[str, Any] | str:
    """How `target` is asked for `sampler`, read from `name` set to `value`."""
    theirs = sampler.reads.get(target.name) or sampler.reads.get(None)
    if sampler.carries == COUNTED:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name} is not a number of tokens: {value!r}"
        if (left := value - produced) <= 0:
            return {name: DROP}  # written already: nothing is left to hold the rest to
        if theirs is None:
            return _lacks(target, name, sampler)
        return {name: DROP, theirs: left} if theirs != name else {name: left}
    if sampler is WHOLE_PENALTY and target.name == LLAMA:
        if target.context is None:
            return f"{target.said}'s context is not known: repeat_last_n cannot cover it all"
        return {name: DROP, "repeat_penalty": value, "repeat_last_n": target.context}
    if theirs is None:
        return _lacks(target, name, sampler)
    if name == "bad_words" and (word := _begun(value, written)) is not None:
        return f"the answer so far ends in the start of {word!r}, which {name} counts anew"
    return {theirs: value} if theirs == name else {name: DROP, theirs: value}


def _off_in_terms(sampler: Sampler, name: str, value: Any, target: Engine) -> dict[str, Any]:
    """A sampler left off, as `target` leaves it off (vLLM's top-k of -1 is llama.cpp's
    0: llama-cpp-python refuses -1)."""
    theirs = sampler.reads.get(target.name) or sampler.reads.get(None)
    if theirs is None or sampler.neutral is DROP or value == sampler.neutral:
        return {}
    return {theirs: sampler.neutral} if theirs == name else {name: DROP, theirs: sampler.neutral}


def _lacks(target: Engine, name: str, sampler: Sampler) -> str:
    if target.name is None:
        return f"{target.said}: whether it reads {name} ({sampler.what}) is not known"
    return f"{target.said} has no {name} as it was read ({sampler.what})"


def _whole_window(body: dict[str, Any], first: Engine) -> bool:
    """Whether llama.cpp's penalty window, `repeat_last_n`, held the whole context."""
    window = body.get("repeat_last_n")
    if window == -1:
        return True  # (llama-server's own "the whole context", where it is taken)
    return isinstance(window, int) and first.context is not None and window >= first.context


def _begun(words: Any, written: str) -> str | None:
    """A word of vLLM's `bad_words` whose start the answer so far ends in: vLLM matches a
    word's tokens among those it generated itself, so after the cut it would not see the
    start, and would let the word be finished."""
    for word in words if isinstance(words, list) else ():
        for spelled in (word, " " + word) if isinstance(word, str) else ():
            if any(written.endswith(spelled[:end]) for end in range(1, len(spelled))):
                return word
    return None
