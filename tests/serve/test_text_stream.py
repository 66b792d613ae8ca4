"""Incremental detokenization and stop strings, on a stand-in tokenizer (one character per
token id, ids >= 1000 halves of a two-token character, 0 a special token the decoder skips), so
every split can be forced; then on real tokenizers: SmolLM2's byte-level BPE and a Llama-style
SentencePiece one built here from a small vocabulary."""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from raykv.serve.protocol import MAX_STOP_CHARS, ApiError, CompletionRequest, parse
from raykv.serve.text_stream import TextStream

EURO = "\u20ac"
SPECIAL = 0


def decode(ids: Sequence[int]) -> str:
    ids = [i for i in ids if i != SPECIAL]  # as skip_special_tokens: gone before decoding
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


# ---- the cost of a token does not grow with the stream -------------------------------------


@dataclass(slots=True)
class CountingDecode:
    """The stand-in decoder, counting the token ids it is handed."""

    calls: int = 0
    ids: int = 0
    largest: int = 0

    def __call__(self, token_ids: Sequence[int]) -> str:
        self.calls += 1
        self.ids += len(token_ids)
        self.largest = max(self.largest, len(token_ids))
        return decode(token_ids)


def mixed_ids(n: int) -> list[int]:
    """``n`` token ids of words, split characters and skipped specials."""
    unit = [*ids("ab c"), 1000, 1001, SPECIAL, *ids(" d")]
    return (unit * (n // len(unit) + 1))[:n]


def decode_work(n: int) -> CountingDecode:
    counter = CountingDecode()
    stream = TextStream(counter)
    for token in mixed_ids(n):
        stream.push([token])
    assert stream.text == decode(mixed_ids(n))
    return counter


def test_decoding_work_per_token_does_not_grow_with_the_stream() -> None:
    small, big = decode_work(1_000), decode_work(4_000)
    # linear: four times the tokens, four times the ids decoded (decoding the whole list on each
    # push made it sixteen), and no single call longer than a few tokens
    assert big.ids <= 4.2 * small.ids
    assert big.ids <= 4 * 4_000 and big.largest <= 8


def test_a_long_run_of_skipped_tokens_or_broken_bytes_keeps_the_window_short() -> None:
    counter = CountingDecode()
    stream = TextStream(counter)
    out = stream.push(ids("a"))
    for _ in range(3_000):
        out += stream.push([SPECIAL])
    out += stream.push(ids("b"))
    assert out == "ab" and counter.largest <= 40


# ---- the text each token added ---------------------------------------------------------------


def test_each_token_s_text_joins_to_the_text_and_a_split_character_is_its_last_token_s() -> None:
    stream = TextStream(decode)
    stream.push([*ids("ab"), 1000])
    assert stream.token_texts() == ["a", "b", ""]
    stream.push([1001, SPECIAL, *ids("c")])
    assert stream.token_texts() == ["a", "b", "", EURO, "", "c"]
    assert stream.token_texts(2, 4) == ["", EURO]
    assert stream.token_offsets() == [0, 1, 2, 2, 3, 3]
    assert stream.token_offsets(3, 5) == [2, 3]
    assert "".join(stream.token_texts()) == stream.text == "ab" + EURO + "c"


def test_token_texts_cover_the_text_before_a_stop_cut_it() -> None:
    stream = TextStream(decode, ["c"])
    assert stream.push(ids("abcd")) == "ab" and stream.stopped
    assert stream.text == "ab" and "".join(stream.token_texts()) == "abcd"


def test_a_character_left_incomplete_at_the_end_goes_to_the_last_token() -> None:
    stream = TextStream(decode)
    assert stream.push([*ids("a"), 1000]) == "a"
    assert stream.finish() == "\ufffd"
    assert stream.token_texts() == ["a", "\ufffd"] and stream.text == "a\ufffd"


# ---- stop strings in time linear in the text ------------------------------------------------


class CountedStop(str):
    """A stop string counting the characters read out of it by indexing or slicing."""

    __slots__ = ()
    reads = [0]

    def __getitem__(self, key):  # type: ignore[override]
        out = super().__getitem__(key)
        CountedStop.reads[0] += len(out)
        return out


@pytest.mark.parametrize("text", ["the quick brown fox. " * 10, "ab" * 100 + "x"])
def test_matching_long_stop_strings_reads_each_new_character_a_few_times(text: str) -> None:
    stops = [CountedStop(s * 20_000) for s in ("q", "ab", "aab", "z")][:4]
    stream = TextStream(decode, list(stops))
    CountedStop.reads[0] = 0  # what building the stream read is not the pushes' cost
    out = "".join(stream.push(ids(c)) for c in text) + stream.finish()
    assert out == text and not stream.stopped
    # a new character is compared with each stop string a bounded number of times (amortized),
    # whatever the stop strings' lengths; the old suffix test read O(len(stop)^2) a push
    assert CountedStop.reads[0] <= 2 * len(stops) * len(text)


def test_a_long_stop_string_is_found_across_many_pushes() -> None:
    stop = "ab" * 500 + "!"
    stream = TextStream(decode, [stop, "zz"])
    text = "x" + "ab" * 700 + "!" + "tail"
    out = "".join(stream.push(ids(text[i : i + 7])) for i in range(0, len(text), 7))
    assert stream.stopped and out == stream.text == text[: text.index(stop)]


@pytest.mark.parametrize(
    ("stop", "text", "where"),
    [("aab", "aaab", 1), ("abab", "abaabab", 3), ("aaa", "aa aaa", 3), ("abcabd", "abcabcabd", 3)],
)
def test_a_stop_string_is_found_after_a_partial_match_fails(stop: str, text: str, where: int):
    stream = TextStream(decode, [stop])
    out = "".join(stream.push(ids(c)) for c in text)
    assert stream.stopped and out == text[:where]


def test_the_start_of_a_stop_string_is_held_while_a_split_character_follows_it() -> None:
    stream = TextStream(decode, ["a" + EURO])
    assert stream.push([*ids("xa"), 1000]) == "x"  # "a" may begin the stop, the half may end it
    assert stream.push([1001]) == "" and stream.stopped and stream.text == "x"


def test_a_stop_string_longer_than_the_cap_is_refused() -> None:
    assert MAX_STOP_CHARS == 1_000
    parse(CompletionRequest, {"prompt": "x", "stop": ["a" * MAX_STOP_CHARS]})
    with pytest.raises(ApiError) as caught:
        parse(CompletionRequest, {"prompt": "x", "stop": ["end", "a" * (MAX_STOP_CHARS + 1)]})
    assert caught.value.status == 400 and caught.value.param == "stop"
    assert f"at most {MAX_STOP_CHARS} characters" in caught.value.message


# ---- against decoding everything at once ----------------------------------------------------

UNITS = ["a", "b", "c", " ", EURO, "special"]


def unit_ids(unit: str) -> list[int]:
    return {EURO: [1000, 1001], "special": [SPECIAL]}.get(unit) or ids(unit)


def held_back(text: str, stops: list[str]) -> int:
    """The longest end of ``text`` that begins a stop string (the old rule, by brute force)."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


@given(
    units=st.lists(st.sampled_from(UNITS), max_size=40),
    stops=st.lists(st.text(alphabet="abc " + EURO, min_size=1, max_size=5), max_size=4),
    sizes=st.lists(st.integers(0, 6), min_size=1, max_size=8),
)
def test_the_stream_releases_what_whole_decoding_and_searching_would(
    units: list[str], stops: list[str], sizes: list[int]
) -> None:
    token_ids = [t for u in units for t in unit_ids(u)]
    stream = TextStream(decode, stops)
    released, at, turn = "", 0, 0
    expected = None
    while at < len(token_ids) and expected is None:
        size = sizes[turn % len(sizes)] or (turn > 100 and 1)  # empty pushes, but not forever
        turn += 1
        chunk = token_ids[at : at + size]
        at += len(chunk)
        released += stream.push(chunk)
        so_far = decode(token_ids[:at]).rstrip("\ufffd")  # the stable text: no half character
        hits = [i for i in (so_far.find(s) for s in stops) if i >= 0]
        if hits:  # the earliest match among those complete by this push wins
            expected = so_far[: min(hits)]
            assert stream.stopped and released == expected
        else:
            assert not stream.stopped and stream.text == so_far
            assert released == so_far[: len(so_far) - held_back(so_far, stops)]
        assert "".join(stream.token_texts()) == decode(stream.tokens).rstrip("\ufffd")
    released += stream.finish()
    if expected is None:
        expected = decode(token_ids)
        assert "".join(stream.token_texts()) == expected
    assert released == stream.text == expected


# ---- real tokenizers ------------------------------------------------------------------------

MULTILINGUAL = (
    "Hello, world! Ça va? naïve café — 世界你好\uff0cこんにちは。"
    "한국어 문장입니다. 😀👍🏽 👨\u200d👩\u200d👧 🇯🇵 "
    "Привет, мир. مرحبا بالعالم. ภาษาไทย हिन्दी\n\n\tdef f(x):\n        return x  # done\n   end"
)


def stream_all(decoder: Callable[[Sequence[int]], str], token_ids: list[int], chunk: int):
    """Push ``token_ids`` ``chunk`` at a time; the stream and everything it released."""
    stream = TextStream(decoder)
    out = "".join(stream.push(token_ids[i : i + chunk]) for i in range(0, len(token_ids), chunk))
    return stream, out + stream.finish()


def check_against_whole_decode(
    decoder: Callable[[Sequence[int]], str],
    token_ids: list[int],
    streamed: Callable[[Sequence[int]], str] | None = None,
) -> TextStream:
    """Stream ``token_ids`` in chunks of several sizes (decoding with ``streamed``, by default
    ``decoder``): each time the same text as ``decoder`` gives them all at once."""
    whole = decoder(token_ids)
    for chunk in (1, 2, 3, 7):
        stream, out = stream_all(streamed or decoder, token_ids, chunk)
        assert out == stream.text == whole
        assert "".join(stream.token_texts()) == whole
    return stream


def with_specials(token_ids: list[int], specials: list[int], every: int) -> list[int]:
    """``token_ids`` with a special token after every ``every``-th one (inside split characters
    too)."""
    out: list[int] = []
    for i, token in enumerate(token_ids):
        out.append(token)
        if i % every == every - 1:
            out.append(specials[i % len(specials)])
    return out


@pytest.fixture(scope="module")
def smollm2(smollm2_hf_tokenizer):
    """SmolLM2's encode and decode, as raykv's Tokenizer calls them."""
    hf = smollm2_hf_tokenizer

    def encode(text: str) -> list[int]:
        return list(hf.encode(text, add_special_tokens=False))

    def decoder(token_ids: Sequence[int]) -> str:
        return hf.decode(list(token_ids), skip_special_tokens=True)

    return hf, encode, decoder


def test_smollm2_multilingual_text_streams_as_it_decodes_whole(smollm2) -> None:
    hf, encode, decoder = smollm2
    token_ids = encode(MULTILINGUAL)
    split = [t for t in token_ids if "\ufffd" in decoder([t])]
    assert len(split) > 10  # the premise: emoji and CJK characters span tokens
    stream = check_against_whole_decode(decoder, token_ids)
    assert all("\ufffd" not in text for text in stream.token_texts())
    specials = [
        hf.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|im_start|>", "<|endoftext|>")
    ]
    assert decoder(specials) == ""
    check_against_whole_decode(decoder, with_specials(token_ids, specials, 3))
    check_against_whole_decode(decoder, specials + token_ids + specials)


def test_smollm2_broken_bytes_stream_as_they_decode_whole(smollm2) -> None:
    hf, encode, decoder = smollm2
    # a byte token that repeated makes no character: one replacement character each
    lone = next(
        t for t in range(len(hf)) if decoder([t]) == "\ufffd" and decoder([t] * 3) == "\ufffd" * 3
    )
    counter = 0

    def counting(token_ids: Sequence[int]) -> str:
        nonlocal counter
        counter = max(counter, len(token_ids))
        return decoder(token_ids)

    token_ids = [*encode("before"), *[lone] * 200, *encode(" after 世界")]
    check_against_whole_decode(decoder, token_ids, counting)
    assert counter <= 40  # the window stays short even when nothing decodes cleanly


@given(text=st.text(alphabet="ab é世界😀👍🏽\n\t.", max_size=30), seed=st.integers(0, 1_000))
def test_smollm2_random_text_streams_as_it_decodes_whole(smollm2, text: str, seed: int) -> None:
    _, encode, decoder = smollm2
    token_ids = encode(text)
    chunk = random.Random(seed).randint(1, 4)
    stream, out = stream_all(decoder, token_ids, chunk)
    assert out == "".join(stream.token_texts()) == decoder(token_ids)


@given(token_ids=st.lists(st.integers(0, 49_151), max_size=40), chunk=st.integers(1, 4))
def test_smollm2_random_token_ids_stream_as_they_decode_whole(
    smollm2, token_ids: list[int], chunk: int
) -> None:
    _, _, decoder = smollm2  # any ids: broken bytes and special tokens in any order
    stream, out = stream_all(decoder, token_ids, chunk)
    assert out == "".join(stream.token_texts()) == decoder(token_ids)


def llama_style_tokenizer():
    """A Llama-style SentencePiece BPE tokenizer (metaspace, byte fallback) on a vocabulary built
    here: ASCII letters, a few whole words, and bytes for everything else."""
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for char in "\u2581" + string.ascii_letters + string.digits + string.punctuation + "é":
        vocab.setdefault(char, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in ("\u2581Hello", "\u2581world", "\u2581the", "\u2581is", "\u2581caf", "ing"):
        for end in range(2, len(word) + 1):
            if word[:end] not in vocab:
                merges.append((word[: end - 1], word[end - 1]))
                vocab[word[:end]] = len(vocab)
    return transformers.LlamaTokenizer(vocab=vocab, merges=merges)


@pytest.fixture(scope="module")
def llama_style():
    """The Llama-style tokenizer and its decode, as raykv's Tokenizer calls it."""
    tokenizer = llama_style_tokenizer()

    def decoder(token_ids: Sequence[int]) -> str:
        return tokenizer.decode(list(token_ids), skip_special_tokens=True)

    return tokenizer, decoder


def test_a_sentencepiece_tokenizer_keeps_the_space_a_lone_token_would_lose(llama_style) -> None:
    tokenizer, decoder = llama_style
    token_ids = tokenizer.encode(
        "Hello world, the café is 世界 😀 testing", add_special_tokens=False
    )
    world = tokenizer.convert_tokens_to_ids("\u2581world")
    assert world in token_ids and decoder([world]) == "world"  # the premise: a lone token's space
    assert decoder(token_ids).startswith("Hello world, the café is 世界 😀")
    check_against_whole_decode(decoder, token_ids)
    check_against_whole_decode(decoder, with_specials(token_ids, [1, 2], 2))
    check_against_whole_decode(decoder, [2, 2, *token_ids])
    # a lone "▁" first decodes to nothing alone, yet to a space once a token follows it; so
    # does it behind a run of special tokens, which must not make the window grow
    space, hello = tokenizer.convert_tokens_to_ids(["▁", "▁Hello"])
    assert decoder([space]) == "" and decoder([space, space]) == " "
    check_against_whole_decode(decoder, [space, space, *token_ids])
    check_against_whole_decode(decoder, [space, *[2] * 40, hello, space, *[1] * 40, hello])
    check_against_whole_decode(decoder, [*[2] * 40, space, *[1] * 40, hello])


@given(
    text=st.text(alphabet="ab Hé世界😀\n.", max_size=40),
    specials=st.lists(st.integers(0, 60), max_size=5),
    chunk=st.integers(1, 4),
)
def test_llama_style_random_text_streams_as_it_decodes_whole(
    llama_style, text: str, specials: list[int], chunk: int
) -> None:
    tokenizer, decoder = llama_style
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    for where in specials:
        token_ids.insert(min(where, len(token_ids)), 2)
    stream, out = stream_all(decoder, token_ids, chunk)
    assert out == "".join(stream.token_texts()) == decoder(token_ids)
