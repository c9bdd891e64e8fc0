"""The server's ``echo`` and prompt logprobs, on the tiny model with SmolLM2's tokenizer, through the
official ``openai`` client and raw HTTP on 127.0.0.1 (ephemeral port): ``echo`` puts the prompt's text
before the completion and, with ``logprobs``, the prompt tokens' logprobs (the first null) before the
generated ones, equal to the engine's in-process values, streamed or not, for text and token-id
prompts and ``n`` choices; ``max_tokens: 0`` scores the prompt alone; the request lm-eval's
``local-completions`` sends for a loglikelihood answers what it parses; vLLM's ``prompt_logprobs``
extra field (completions and chat); bad values are a 400 naming the field."""
from __future__ import annotations

import pytest

from devin_compile.runtime.sampling import SamplingParams
from serve_model import openai_client, post, running_server, tiny_chat_opt

MODEL = "tiny"
PROMPT = "The cat sat on the mat and"
CHAT = [{"role": "user", "content": "Hi there"}]
K = 2
N = 5


@pytest.fixture(scope="module")
def opt():
    return tiny_chat_opt(num_kv_blocks=256, max_num_seqs=16)


@pytest.fixture(scope="module")
def refs(opt):
    """In-process outputs (prompt and token logprobs), computed before the server takes over the engine."""
    ids = opt.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    out, chat = opt.engine.generate([ids, opt.chat_ids(CHAT)],
                                    SamplingParams(max_new_tokens=N, logprobs=K, prompt_logprobs=K))
    assert len(out.prompt_logprobs) == len(ids) > 3 and out.prompt_logprobs[0] is None
    return {"ids": ids, "out": out, "chat": chat}


@pytest.fixture(scope="module")
def server(opt, refs):
    with running_server(opt, MODEL) as srv:
        yield srv


@pytest.fixture
def client(server):
    return openai_client(server)


def piece(server, t: int) -> str:
    return server.tokenizer.decode([t])


def check_echo_logprobs(server, lp, ids: list[int], prompt_lps: list, gen_lps: list, k: int = K) -> None:
    """The legacy logprobs object under echo: prompt tokens (first null) then the generated ones."""
    assert lp["tokens"] == [piece(server, t) for t in ids] + [piece(server, e.token_id) for e in gen_lps]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = prompt_lps[1:] + gen_lps
    assert lp["token_logprobs"][1:] == pytest.approx([e.logprob for e in want], abs=1e-4)
    for top, e in zip(lp["top_logprobs"][1:], want):
        ref = {piece(server, t): v for t, v in e.top[:k]}
        ref.setdefault(piece(server, e.token_id), e.logprob)
        assert top.keys() == ref.keys() and list(top.values()) == pytest.approx(list(ref.values()), abs=1e-4)
    offsets = [0]
    for s in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(s))
    assert lp["text_offset"] == offsets


def test_echo_returns_the_prompt_then_the_completion(server, client, refs):
    out = refs["out"]
    completion = server.tokenizer.decode(out.output_ids, skip_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, echo=True, logprobs=K)
    c = r.choices[0]
    assert c.text == PROMPT + completion and r.usage.prompt_tokens == len(refs["ids"])
    check_echo_logprobs(server, c.logprobs.model_dump(), refs["ids"], out.prompt_logprobs, out.logprobs)
    # without logprobs: the text alone; without echo: the completion alone, as before
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, echo=True)
    assert r.choices[0].text == PROMPT + completion and r.choices[0].logprobs is None
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, logprobs=K)
    assert r.choices[0].text == completion and len(r.choices[0].logprobs.tokens) == N


def test_echo_of_token_ids_and_n_choices(server, refs):
    ids, out = refs["ids"], refs["out"]
    status, _, body = post(server, "/v1/completions", {"model": MODEL, "prompt": [ids, ids[:4]], "max_tokens": N,
                                                       "temperature": 0, "echo": True, "logprobs": 1, "n": 2,
                                                       "ignore_eos": True})
    assert status == 200 and len(body["choices"]) == 4
    completion = server.tokenizer.decode(out.output_ids, skip_special_tokens=True)
    for c in body["choices"][:2]:
        assert c["text"] == server.tokenizer.decode(ids) + completion
        check_echo_logprobs(server, c["logprobs"], ids, out.prompt_logprobs, out.logprobs, 1)
    for c in body["choices"][2:]:
        assert c["text"].startswith(server.tokenizer.decode(ids[:4])) and len(c["logprobs"]["tokens"]) == 4 + N


def test_zero_max_tokens_scores_the_prompt_alone(server, client, refs):
    ids, out = refs["ids"], refs["out"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, temperature=0, echo=True, logprobs=K)
    c = r.choices[0]
    assert c.text == PROMPT and c.finish_reason == "length" and r.usage.completion_tokens == 0
    check_echo_logprobs(server, c.logprobs.model_dump(), ids, out.prompt_logprobs, [])


def test_streamed_echo_equals_the_whole_answer(server, client, refs):
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, echo=True, logprobs=K)
    whole = client.completions.create(**body).choices[0]
    text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(**body, stream=True):
        text += chunk.choices[0].text
        lp = chunk.choices[0].logprobs
        if lp is not None:
            for key in merged:
                merged[key] += getattr(lp, key)
    assert text == whole.text and merged == whole.logprobs.model_dump()
    zero = "".join(ch.choices[0].text for ch in client.completions.create(**{**body, "max_tokens": 0}, stream=True))
    assert zero == PROMPT


def test_the_request_lm_eval_sends_for_a_loglikelihood(server, refs):
    """lm-eval's local-completions: token ids, max_tokens 1, logprobs 1, echo, temperature 0; it sums
    ``token_logprobs[ctxlen:-1]`` (the continuation) and calls it greedy when each equals its top's max."""
    ids, out = refs["ids"], refs["out"]
    ctxlen = 3
    status, _, body = post(server, "/v1/completions", {"model": MODEL, "prompt": [ids], "max_tokens": 1,
                                                       "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234})
    assert status == 200
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    cont = lp["token_logprobs"][ctxlen:-1]
    assert sum(cont) == pytest.approx(sum(e.logprob for e in out.prompt_logprobs[ctxlen:]), abs=1e-4)
    greedy = all(t == max(top.values()) for t, top in zip(cont, lp["top_logprobs"][ctxlen:-1]))
    assert greedy == all(e.rank == 1 for e in out.prompt_logprobs[ctxlen:])


def test_prompt_logprobs_extra_field(server, refs):
    out = refs["out"]
    status, _, body = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 0,
                                                       "temperature": 0, "prompt_logprobs": K})
    assert status == 200
    c = body["choices"][0]
    assert c["text"] == "" and c["logprobs"] is None
    check_vllm_prompt_logprobs(server, c["prompt_logprobs"], out.prompt_logprobs)
    chat = refs["chat"]
    status, _, body = post(server, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 2,
                                                            "temperature": 0, "prompt_logprobs": 1})
    assert status == 200
    check_vllm_prompt_logprobs(server, body["prompt_logprobs"], chat.prompt_logprobs, 1)
    status, _, body = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
    assert "prompt_logprobs" not in body["choices"][0]  # not asked: not there


def check_vllm_prompt_logprobs(server, got: list, ref: list, k: int = K) -> None:
    assert len(got) == len(ref) and got[0] is None
    for d, e in zip(got[1:], ref[1:]):
        mine = d[str(e.token_id)]
        assert mine["logprob"] == pytest.approx(e.logprob, abs=1e-4) and mine["rank"] == e.rank
        assert mine["decoded_token"] == piece(server, e.token_id)
        assert set(d) == {str(e.token_id)} | {str(t) for t, _ in e.top[:k]}
        for r, (t, v) in enumerate(e.top[:k]):
            assert d[str(t)]["logprob"] == pytest.approx(v, abs=1e-4) and d[str(t)]["rank"] in (r + 1, e.rank)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0, "prompt_logprobs": 1}, "max_tokens"),
])
def test_bad_values_get_a_400_naming_the_field(server, client, path, body, param):
    status, _, err = post(server, path, {"model": MODEL, **body})
    assert status == 400 and err["error"]["param"] == param and param in err["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices[0].finish_reason
