"""The text layer of serving: incremental detokenisation (byte-level BPE, never half a UTF-8
character), stop strings spanning tokens, chat templates, OpenAI request checks, and
``OptimizedModel.chat`` / ``stream_text`` against ``generate``."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from devin_compile.text.detokenizer import IncrementalDetokenizer, StopStrings, TextStream
from devin_compile.serve.protocol import APIError, parse_request
from devin_compile.text.chat_template import chat_prompt_ids
from serve_model import smollm2_tokenizer, tiny_chat_opt

TEXT = "Héllo wörld: 日本語のテキスト 🙂🙂 ça va? naïve — ∑x² ½ end"


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def _stream(tok, ids, stop=(), prompt=()):
    s = TextStream(tok, prompt, stop)
    parts = [s.add([i]) for i in ids]
    parts.append(s.finish())
    return parts, s


def test_multibyte_characters_split_across_tokens_are_never_emitted_half(tok):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode([i]) for i in ids), "the test text must split a character across tokens"
    parts, _ = _stream(tok, ids)
    assert "".join(parts) == TEXT
    assert all("\ufffd" not in p for p in parts)
    assert "" in parts  # a token that ends mid-character emits nothing yet


# token ids of real text plus single-byte tokens (which make broken UTF-8 on their own)
_POOL = None


def _pool(tok):
    global _POOL
    if _POOL is None:
        ids = set(tok(TEXT + " The quick brown fox, 12345!\n\tdone.", add_special_tokens=False)["input_ids"])
        ids |= {i for i in range(len(tok)) if len(tok.convert_ids_to_tokens(i)) == 1}  # byte tokens
        ids |= set(tok.all_special_ids)
        _POOL = sorted(ids)
    return _POOL


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 10**6), min_size=1, max_size=40), st.lists(st.integers(0, 10**6), max_size=8))
def test_deltas_concatenate_to_decode_for_any_token_sequence(tok, picks, prompt_picks):
    pool = _pool(tok)
    ids = [pool[p % len(pool)] for p in picks]
    prompt = [pool[p % len(pool)] for p in prompt_picks]
    detok = IncrementalDetokenizer(tok, prompt)
    parts = [detok.add([i]) for i in ids] + [detok.finish()]
    full = tok.decode(ids, skip_special_tokens=True)
    assert "".join(parts) == full
    if "\ufffd" not in full:
        assert all("\ufffd" not in p for p in parts)


def test_stop_string_spanning_tokens_is_cut_and_not_emitted(tok):
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    for stop in ["wörld:", "テキスト 🙂", "🙂 ça", "va? na", "²", "end"]:
        parts, s = _stream(tok, ids, [stop, "never-there"])
        assert "".join(parts) == TEXT[:TEXT.index(stop)], stop
        assert s.stopped and s.stops.matched == stop
        assert stop not in "".join(parts)


def test_stop_strings_earliest_match_wins_and_tail_is_released():
    s = StopStrings(["abcX", "cd"])
    assert s.add("xxab") == "xx"  # "ab" could start "abcX": held back
    assert s.add("c") == ""
    assert s.add("d!") == "ab"  # "cd" matched; "abc" was not a stop after all
    assert s.stopped and s.matched == "cd" and s.add("more") == ""
    s = StopStrings(["STOP"])
    assert s.add("ST") == "" and s.finish() == "ST"


def test_first_token_keeps_its_leading_space(tok):
    prompt = tok("Hello", add_special_tokens=False)["input_ids"]
    ids = tok(" world and more", add_special_tokens=False)["input_ids"]
    parts, _ = _stream(tok, ids, prompt=prompt)
    assert "".join(parts) == " world and more" and parts[0].startswith(" ")


def test_chat_template_and_message_errors(tok):
    ids = chat_prompt_ids(tok, [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert ids == tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False)
    for msgs, msg in [([], "non-empty list"), ([{"role": "robot", "content": "x"}], "messages[0].role"),
                      ([{"role": "user", "content": 3}], "messages[0].content"),
                      ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]")]:
        with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            chat_prompt_ids(tok, msgs)


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x"}, "model"),
    ({"model": "m"}, "prompt"),
    ({"model": "m", "prompt": ""}, "prompt"),
    ({"model": "m", "prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": "9"}, "max_tokens"),
    ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
    ({"model": "m", "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": "m", "prompt": "x", "n": 0}, "n"),
    ({"model": "m", "prompt": "x", "stop": [1]}, "stop"),
    ({"model": "m", "prompt": "x", "seed": 1.5}, "seed"),
    ({"model": "m", "prompt": "x", "logprobs": 21}, "logprobs"),
    ({"model": "m", "prompt": "x", "logprobs": True}, "logprobs"),
    ({"model": "m", "prompt": "x", "speculative": "on"}, "speculative"),
    ({"model": "m", "prompt": "x", "speculative": {"num_tokens": 0}}, "speculative"),
    ({"model": "m", "prompt": "x", "speculative": {"depth": 3}}, "speculative"),
    ({"model": "m", "prompt": "x", "echo": 1}, "echo"),
    ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "x", "max_tokens": 0, "echo": True}, "max_tokens"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"model": "m", "prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "prompt": "x", "timeout": -1}, "timeout"),
    ({"model": "m", "prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ({"model": "m", "prompt": "x", "kv_prune": 3}, "kv_prune"),
])
def test_bad_fields_are_named(body, param):
    with pytest.raises(APIError) as e:
        parse_request(body, chat=False)
    assert e.value.status == 400 and e.value.param == param and param in e.value.message


@pytest.mark.parametrize("body, chat, message", [
    ({"prompt": "x"}, False, "model is required: a string"),
    ({"model": 5, "prompt": "x"}, False, "model must be a string naming the model (see GET /v1/models), got 5"),
    ({"model": "m"}, True, "messages is required: a non-empty list"),
    ({"model": "m", "messages": None}, True, "messages is required: a non-empty list"),
    ({"model": "m", "messages": {"text": "hi"}}, True, 'messages must be a non-empty list of {\'role\', '
                                                       '\'content\'} objects, got {"text": "hi"}'),
    ({"model": "m", "messages": []}, True, "messages must be a non-empty list"),
])
def test_a_field_sent_wrong_is_not_called_missing(body, chat, message):
    """The soak's malformed bodies: a field that is there but wrong is named as wrong, not as required."""
    with pytest.raises(APIError) as e:
        parse_request(body, chat=chat)
    assert e.value.status == 400 and message in e.value.message


def test_chat_logprobs_speculative_and_defaults():
    msgs = [{"role": "user", "content": "x"}]
    assert parse_request({"model": "m", "messages": msgs}, chat=True).logprobs is None
    assert parse_request({"model": "m", "messages": msgs, "logprobs": True}, chat=True).logprobs == 0
    assert parse_request({"model": "m", "messages": msgs, "logprobs": True, "top_logprobs": 5}, chat=True).logprobs == 5
    for body, param in [({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 2}, "logprobs"),
                        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")]:
        with pytest.raises(APIError) as e:
            parse_request({"model": "m", "messages": msgs, **body}, chat=True)
        assert e.value.status == 400 and e.value.param == param
    r = parse_request({"model": "m", "prompt": "x", "speculative": {"num_tokens": 2}, "logprobs": 3}, chat=False)
    kw = r.sampling_kwargs(0)
    assert kw["logprobs"] == 3 and kw["speculative"].num_tokens == 2
    assert parse_request({"model": "m", "prompt": "x", "speculative": False}, chat=False).speculative is False
    r = parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5,
                       "seed": 3, "n": 2, "temperature": 0.5}, chat=True)
    assert r.max_tokens == 5 and [r.sampling_kwargs(i)["seed"] for i in range(2)] == [3, 4]


# ---------------------------------------------------------------- OptimizedModel.chat / stream_text
@pytest.fixture(scope="module")
def opt():
    return tiny_chat_opt(num_kv_blocks=128)


def test_stream_text_equals_generate(opt):
    for prompt in ["Once upon a time", "Le café est très bon 日本"]:
        text = opt.generate(prompt, max_new_tokens=24)
        parts = list(opt.stream_text(prompt, max_new_tokens=24))
        assert "".join(parts) == text and len(parts) > 1
    assert opt.engine.kv.allocator.num_used == 0


def test_stream_text_sampled_is_seeded_and_stops(opt):
    a = "".join(opt.stream_text("Hi", 32, do_sample=True, temperature=1.0, seed=7))
    b = "".join(opt.stream_text("Hi", 32, do_sample=True, temperature=1.0, seed=7))
    c = "".join(opt.stream_text("Hi", 32, do_sample=True, temperature=1.0, seed=8))
    assert a == b and a != c
    ids = opt.tokenizer("Hi", add_special_tokens=False)["input_ids"]
    full = opt.generate([ids], max_new_tokens=32, do_sample=True, temperature=1.0, seed=7)[0]
    assert a == opt.tokenizer.decode(full, skip_special_tokens=True)
    stop = a[len(a) // 3: len(a) // 3 + 4]
    cut = "".join(opt.stream_text("Hi", 32, stop=[stop], do_sample=True, temperature=1.0, seed=7))
    assert cut == a[:a.index(stop)]
    assert opt.engine.kv.allocator.num_used == 0  # the stopped request was aborted, its blocks freed


def test_chat_applies_the_template(opt):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    ids = opt.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = opt.tokenizer.decode(opt.generate([ids], max_new_tokens=16)[0], skip_special_tokens=True)
    assert opt.chat(msgs, max_new_tokens=16) == expected
