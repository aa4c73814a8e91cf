"""TextStreamer: deltas never pass a stop string or a half-decoded character, and always add up to
the final text. Pure functions on a toy character-level decode.
Run: python -m pytest tests/serve/test_text_streamer.py -q
"""

from __future__ import annotations

import pytest

from dominospec.serve.streaming import TextStreamer, stop_prefix_length

VOCAB = {1: "a", 2: "b", 3: "c", 4: "\ufffd", 5: "é"}


def decode(ids: list[int]) -> str:
    """Character tokens; id 4 then 5 stands for one character split over two tokens."""
    text = "".join(VOCAB[i] for i in ids)
    return text.replace("\ufffdé", "é")


def test_stop_prefix_length():
    assert stop_prefix_length("xxab", ("abc",)) == 2
    assert stop_prefix_length("xxabc", ("abc",)) == 0  # the whole stop string is not a *proper* prefix
    assert stop_prefix_length("xxa", ("bc", "ab")) == 1
    assert stop_prefix_length("anything", ()) == 0


@pytest.mark.parametrize("stops", [(), ("bc",), ("cab", "zz")])
def test_deltas_add_up_and_never_pass_a_stop(stops):
    ids = [1, 2, 1, 2, 3, 1, 1, 2, 3, 3]
    full = decode(ids)
    cut = min([full.find(s) for s in stops if s in full], default=len(full))
    final = full[:cut]
    streamer, sent = TextStreamer(decode, stops), ""
    for i in range(0, len(ids), 2):  # two tokens per round
        sent += streamer.push(ids[i:i + 2])
        assert final.startswith(sent)
        assert not any(s in sent for s in stops)
    assert sent + streamer.finish(final) == final


def test_a_split_character_waits_for_its_second_token():
    streamer = TextStreamer(decode)
    assert streamer.push([1, 4]) == "a"
    assert streamer.push([5]) == "é"
    assert streamer.finish("aé") == ""
