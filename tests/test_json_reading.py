"""The addon reads chunks with msgspec and falls back to json: the value (or the refusal)
is always json.loads's, whatever a server sends. It writes request bodies the same way:
what it writes reads back as what json.dumps writes."""

from __future__ import annotations

import json
import random
import struct

import pytest

from addon.formats.shape import dumps, loads

CASES = [
    b'{"choices":[{"index":0,"delta":{"content":" world"},"finish_reason":null}]}',
    b'{"a":"\\ud800x"}',  # half a character, as a server escapes it: msgspec refuses
    b"123456789012345678901234567890",  # past 64 bits: an exact int, never a float
    b"-123456789012345678901234567890",
    b'{"a": 1.5e400}',  # past a float: json's inf
    b"NaN",
    b'{"a":1,"a":2}',
    '{"é": "ü"}',
    bytearray(b'{"x": [1, 2.5, true, false, null]}'),
    b"[" * 200 + b"]" * 200,
]
REFUSED = [b"", b'{"a":}', b"\xff", b'"\x01"', b"[" * 5000 + b"]" * 5000]


@pytest.mark.parametrize("raw", CASES)
def test_the_value_is_jsons(raw) -> None:
    got, want = loads(raw), json.loads(raw)
    assert repr(got) == repr(want) and type(got) is type(want)


@pytest.mark.parametrize("raw", REFUSED)
def test_what_json_refuses_is_refused(raw) -> None:
    with pytest.raises(ValueError):
        loads(raw)


def test_floats_round_as_json_rounds_them() -> None:
    rng = random.Random(7)
    for _ in range(5000):
        x = struct.unpack("d", rng.getrandbits(64).to_bytes(8, "little"))[0]
        for text in (repr(x), f"{rng.uniform(-30, 0):.{rng.randint(1, 20)}f}"):
            if text in ("nan", "inf", "-inf"):
                continue
            assert repr(loads(text.encode())) == repr(json.loads(text)), text


@pytest.mark.parametrize("raw", CASES)
def test_what_is_written_reads_as_jsons(raw) -> None:
    value = json.loads(raw)
    assert repr(json.loads(dumps(value))) == repr(json.loads(json.dumps(value)))


def test_a_prompt_of_ids_is_written_by_msgspec_and_anything_it_would_change_by_json() -> None:
    ids = {"prompt": list(range(32000)), "temperature": 0.7, "stop": ["\n"]}
    assert dumps(ids) == json.dumps(ids, separators=(",", ":")).encode()  # msgspec's
    for odd in (float("nan"), float("inf"), "\ud800"):
        body = {"prompt": [1, 2], "temperature": odd}
        assert dumps(body) == json.dumps(body).encode()  # NaN as NaN, never null
        body = {"prompt": [1, 2], "stop": None, "n_probs": [odd]}  # beside a real null too
        assert dumps(body) == json.dumps(body).encode()
    # A null that is one (a field sent as null, the word in a prompt) is msgspec's still.
    for nulls in ({**ids, "stop": None}, {**ids, "prompt": ["x is null", *ids["prompt"]]}):
        assert dumps(nulls) == json.dumps(nulls, separators=(",", ":")).encode()
