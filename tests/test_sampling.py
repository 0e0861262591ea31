"""Each sampling field of a request, for every pair of engines an answer can move between
(llama-server, vLLM, llama-cpp-python, a server whose engine is not known): carried under
the next engine's name for the same sampler, counted from the cut, neutral where the
first engine did not read it, or refused with the reason (addon/handoff/sampling.py).
Pure decisions from what each engine reads (no server: what each reads is taken from its
source, named in the module); the handoffs that act on them run against real servers in
tests/test_sampling_handoffs.py."""

from __future__ import annotations

from typing import Any

import pytest

from addon.handoff.sampling import Engine, carried, refusal

LLAMA, VLLM = Engine.of("llama-server", 4096), Engine.of("vllm", 4096)
ROUTER = Engine.of("llama-server router", 4096)
PYTHON, UNKNOWN = Engine.of("llama-cpp-python", 4096), Engine.of("openai-compatible")
WRITTEN = 10  # tokens written before the cut
BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}


def moved(first: Engine, target: Engine, written: str = " the end.", **fields: Any):
    """What `target` is asked (the continuation's body, its sampling in `target`'s
    terms), or why not."""
    body = {**BODY, **fields}
    why = refusal(body, WRITTEN, written, first, target)
    return why if why is not None else carried(body, body, WRITTEN, first, target)


def sampling(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in BODY}


@pytest.mark.parametrize("first", [LLAMA, VLLM, PYTHON, UNKNOWN, ROUTER])
@pytest.mark.parametrize("target", [LLAMA, VLLM, PYTHON, UNKNOWN, ROUTER])
def test_openais_own_fields_go_everywhere_as_they_are(first: Engine, target: Engine) -> None:
    fields = {"temperature": 0.7, "top_p": 0.9, "seed": 4, "logit_bias": {"5": -1}}
    assert sampling(moved(first, target, **fields)) == fields


# vLLM to llama-server: what llama-server reads under other names, or not at all.
def test_vllms_repetition_penalty_is_llama_servers_over_the_whole_context() -> None:
    assert sampling(moved(VLLM, LLAMA, repetition_penalty=1.2)) == {
        "repeat_penalty": 1.2, "repeat_last_n": 4096,
    }  # fmt: skip


def test_the_whole_context_unknown_refuses_the_repetition_penalty() -> None:
    why = moved(VLLM, Engine.of("llama-server"), repetition_penalty=1.2)
    assert "context is not known" in why


def test_min_tokens_still_to_hold_is_refused_where_the_engine_has_none() -> None:
    why = moved(VLLM, LLAMA, min_tokens=WRITTEN + 5)
    assert why == "llama-server has no min_tokens as it was read (a least number of tokens)"
    assert sampling(moved(VLLM, LLAMA, min_tokens=WRITTEN)) == {}  # held already


@pytest.mark.parametrize(
    "field",
    [{"bad_words": ["river"]}, {"stop_token_ids": [7]}, {"allowed_token_ids": [1, 2]},
     {"include_stop_str_in_output": True}],
)  # fmt: skip
def test_vllms_own_samplers_are_refused_on_llama_server(field: dict[str, Any]) -> None:
    (name,) = field
    assert moved(VLLM, LLAMA, **field).startswith(f"llama-server has no {name}")


# vLLM to vLLM: counted from the cut, or starting over.
def test_min_tokens_is_counted_from_the_cut() -> None:
    assert sampling(moved(VLLM, VLLM, min_tokens=25)) == {"min_tokens": 15}
    assert sampling(moved(VLLM, PYTHON, min_tokens=25)) == {"min_tokens": 15}
    assert sampling(moved(VLLM, VLLM, min_tokens=WRITTEN)) == {}


def test_min_tokens_is_counted_in_a_generate_request_too() -> None:
    """vLLM's own generate route takes the sampling its render resolved from the
    original request: its `min_tokens` is the client's, whole, until lowered here."""
    original = {**BODY, "min_tokens": 25}
    built = {"token_ids": [1, 2], "sampling_params": {"min_tokens": 25, "max_tokens": 90}}
    asked = carried(original, built, WRITTEN, VLLM, VLLM)
    assert asked == {**built, "sampling_params": {"min_tokens": 15, "max_tokens": 90}}


@pytest.mark.parametrize("name", ["presence_penalty", "frequency_penalty"])
def test_vllms_own_count_of_a_penalty_would_start_over(name: str) -> None:
    assert "start over" in moved(VLLM, VLLM, **{name: 0.5})


def test_a_word_vllm_bans_is_refused_where_the_cut_splits_it() -> None:
    assert sampling(moved(VLLM, VLLM, " a calm", bad_words=["river"])) == {"bad_words": ["river"]}
    assert "start of 'river'" in moved(VLLM, VLLM, " a ri", bad_words=["river"])


# llama-server to vLLM: what vLLM lacks, and what llama-server ignored.
@pytest.mark.parametrize(
    "field",
    [{"dynatemp_range": 0.5}, {"top_n_sigma": 1.0}, {"typical_p": 0.8}, {"xtc_probability": 0.1},
     {"dry_multiplier": 0.8}, {"min_keep": 3}, {"samplers": ["top_k", "temperature"]}],
)  # fmt: skip
def test_llama_cpps_own_samplers_are_refused_on_vllm(field: dict[str, Any]) -> None:
    (name,) = field
    assert moved(LLAMA, VLLM, **field).startswith(f"vLLM has no {name}")
    assert sampling(moved(LLAMA, LLAMA, **field)) == field


@pytest.mark.parametrize("field", [{"dynatemp_range": 0}, {"top_n_sigma": -1}, {"typical_p": 1}])
def test_llama_cpps_samplers_left_off_go_anywhere(field: dict[str, Any]) -> None:
    assert sampling(moved(LLAMA, VLLM, **field)) == field


def test_llama_servers_repeat_penalty_over_a_window_is_refused_on_vllm() -> None:
    why = moved(LLAMA, VLLM, repeat_penalty=1.3)
    assert why.startswith("vLLM has no repeat_penalty")
    whole = moved(LLAMA, VLLM, repeat_penalty=1.3, repeat_last_n=4096)
    assert sampling(whole) == {"repetition_penalty": 1.3, "repeat_last_n": 4096}


def test_what_llama_server_ignored_is_neutral_on_vllm() -> None:
    asked = moved(LLAMA, VLLM, repetition_penalty=1.3, min_tokens=50, bad_words=["x"])
    assert sampling(asked) == {"repetition_penalty": 1, "min_tokens": 0}


def test_what_vllm_ignored_is_neutral_on_llama_server() -> None:
    assert sampling(moved(VLLM, LLAMA, repeat_penalty=1.3, mirostat=2)) == {
        "repeat_penalty": 1, "mirostat": 0,
    }  # fmt: skip


# State a new request starts over, whatever the engines.
@pytest.mark.parametrize("target", [LLAMA, VLLM, PYTHON, UNKNOWN])
def test_mirostats_running_target_would_start_over(target: Engine) -> None:
    assert "mirostat would start over" in moved(LLAMA, target, mirostat=2)


# llama-cpp-python: its penalties' window is its server's own.
def test_penalties_over_windows_of_other_sizes_are_refused() -> None:
    assert moved(LLAMA, PYTHON, repeat_penalty=1.1).startswith("llama-cpp-python has no")
    assert moved(PYTHON, LLAMA, presence_penalty=0.3).startswith("llama-server has no")
    assert sampling(moved(PYTHON, PYTHON, repeat_penalty=1.1)) == {"repeat_penalty": 1.1}


def test_vllms_top_k_of_all_is_llama_cpps_zero() -> None:
    assert sampling(moved(VLLM, PYTHON, top_k=-1)) == {"top_k": 0}
    assert sampling(moved(VLLM, LLAMA, top_k=20)) == {"top_k": 20}


# An engine not known: only OpenAI's own fields are taken to mean what they mean.
def test_a_field_a_server_of_unknown_engine_may_not_read_is_refused() -> None:
    why = moved(LLAMA, UNKNOWN, top_k=20)
    assert why == "a server whose engine is not known: whether it reads top_k (top-k) is not known"
    assert "start over" in moved(VLLM, UNKNOWN, presence_penalty=0.2)
    assert moved(LLAMA, UNKNOWN, presence_penalty=0.2).startswith("a server whose engine")


def test_how_a_server_of_unknown_engine_read_a_field_is_not_known() -> None:
    why = moved(UNKNOWN, LLAMA, top_k=20)
    unknown = "the answer so far was written by a server whose engine is not known"
    assert why == f"{unknown}: how it read top_k is not"
    assert sampling(moved(UNKNOWN, LLAMA, top_k=0)) == {"top_k": 0}


def test_nothing_is_refused_or_changed_before_anything_was_written() -> None:
    body = {**BODY, "presence_penalty": 0.5, "repetition_penalty": 1.2, "min_tokens": 50}
    assert refusal(body, 0, "", VLLM, LLAMA) is None
    assert carried(body, body, 0, VLLM, LLAMA) == body
