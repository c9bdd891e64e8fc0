"""The real SmolLM2-135M-Instruct behind the server's text layer: with its chat template it
answers the question a new user asks (raw text gets an immediate EOS), streamed text equals the
batch text, and the openai client over HTTP gets the same answer."""
from __future__ import annotations

import pytest
import torch

import devin_compile
from devin_compile.models import load_model

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def opt():
    model, tok = load_model(None, torch.float32)
    return devin_compile.optimize(model, tokenizer=tok, num_kv_blocks=64)


def test_chat_template_answers_and_streams(opt):
    answer = opt.chat(QUESTION, max_new_tokens=24)
    assert "Paris" in answer
    ids = opt.chat_ids(QUESTION)
    assert "".join(opt.stream_text(ids, 24)) == answer
    assert opt.tokenizer.decode(opt.generate([ids], max_new_tokens=24)[0], skip_special_tokens=True) == answer


def test_openai_client_gets_the_same_answer(opt):
    from openai import OpenAI

    from devin_compile.serve.app import Server
    from devin_compile.serve.server import BackgroundServer

    answer = opt.chat(QUESTION, max_new_tokens=24)
    with BackgroundServer(Server(opt)) as s:
        c = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
        r = c.chat.completions.create(model="smollm2", messages=QUESTION, max_tokens=24, temperature=0)
        streamed = "".join(e.choices[0].delta.content or "" for e in c.chat.completions.create(
            model="smollm2", messages=QUESTION, max_tokens=24, temperature=0, stream=True))
    assert r.choices[0].message.content == answer == streamed
