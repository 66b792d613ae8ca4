"""Incremental detokenization and stop strings, on a stand-in tokenizer (one character per
token id, and ids >= 1000 halves of a two-token character), so every split can be forced."""

from __future__ import annotations

from raykv.serve.text_stream import TextStream

EURO = "\u20ac"


def decode(ids: list[int]) -> str:
    out, i = [], 0
    while i < len(ids):
        if ids[i] >= 1000:  # the first half of a two-token character
            complete = i + 1 < len(ids) and ids[i + 1] >= 1000
            out.append(EURO if complete else "\ufffd")
            i += 2
        else:
            out.append(chr(ids[i]))
            i += 1
    return "".join(out)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_text_comes_out_whole_and_a_split_character_waits_for_its_second_half() -> None:
    stream = TextStream(decode)
    assert stream.push(ids("ab")) == "ab"
    assert stream.push([1000]) == ""  # half a character: held
    assert stream.push([1001]) == EURO
    assert stream.finish() == "" and stream.text == "ab" + EURO


def test_a_stop_string_across_tokens_cuts_the_text_before_it() -> None:
    stream = TextStream(decode, ["STOP"])
    released = stream.push(ids("hello S"))
    assert released == "hello "  # "S" may begin the stop string
    released += stream.push(ids("T"))
    assert released == "hello " and not stream.stopped
    released += stream.push(ids("OP and more"))
    assert stream.stopped and released == "hello " and stream.text == "hello "
    assert stream.push(ids("x")) == ""  # nothing after a stop


def test_held_text_that_was_no_stop_after_all_is_released() -> None:
    stream = TextStream(decode, ["STOP", "end"])
    out = stream.push(ids("a ST"))
    out += stream.push(ids("ART e"))
    assert out == "a START "  # "e" may still begin "end"
    out += stream.finish()
    assert out == "a START e" and not stream.stopped


def test_the_earliest_of_several_stop_strings_wins() -> None:
    stream = TextStream(decode, ["zz", "b"])
    assert stream.push(ids("a b zz")) == "a " and stream.stopped
