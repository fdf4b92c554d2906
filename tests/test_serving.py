"""`bitune-serve`: an OpenAI-compatible server on 127.0.0.1, talked to with the real `openai` client.

Answers are checked against `model.generate` with the chat continuation of docs/generation.md (greedy), on the
miniature base with a random (non-trivial) Bitune adapter saved and loaded back.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

import pytest
import torch

openai = pytest.importorskip("openai", reason="the serving tests need the `serve` extra")
pytest.importorskip("fastapi", reason="the serving tests need the `serve` extra")

from peft import PeftModel  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from peft_bitune import compat  # noqa: E402
from peft_bitune.caches import BituneCache  # noqa: E402
from peft_bitune.serving import ConversationStore, KeptConversation  # noqa: E402
from peft_bitune.serving.app import build_app  # noqa: E402
from peft_bitune.serving.engine import ChatEngine  # noqa: E402
from peft_bitune.serving.server import serving_in_thread  # noqa: E402
from peft_bitune.serving.streaming import StopTextFilter, TextStream, cut_at_stop  # noqa: E402
from reference import make_bitune  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(ROOT, "examples", "miniature", "base")
TEMPLATE_FILE = os.path.join(ROOT, "examples", "miniature", "chat_template.jinja")
NAME = "miniature-bitune"
MAX_TOKENS = 6
REQUEST_TIMEOUT_S = 300  # generous: on a loaded CI machine a request may wait behind all the others
STORIES = [
    "Story: Ana has 2 hats. Bo has 5 hats.\nAsk: How many hats do they have?",
    "Story: Leki packed a map, a coin and a vase into a bag.\nAsk: Is there a book in the bag?",
    "Story: Zafu packed a cup and a coin into a bag.\nAsk: How many things are in the bag?",
    "Story: Kuza packed a vase, a rope and a box into a bag.\nAsk: What went into the bag first?",
    "Story: Mio has 3 cups. Tey has 1 cup.\nAsk: Who has more cups?",
    "Story: Ro packed a hat and a map into a bag.\nAsk: What went into the bag last?",
    "Story: Nel has 4 coins. Pim has 4 coins.\nAsk: Do they have the same number of coins?",
    "Story: Oda packed a rope into a bag.\nAsk: Is there a rope in the bag?",
]
FOLLOW_UPS = ["Ask: Are you sure?", "Ask: Say it again."]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("serving") / "adapter"
    make_bitune(AutoModelForCausalLM.from_pretrained(BASE), seed=3).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def template():
    with open(TEMPLATE_FILE, encoding="utf-8") as file:
        return file.read()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(BASE)


def load_model(adapter_dir):
    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), adapter_dir).eval()


@pytest.fixture(scope="module")
def reference_model(adapter_dir):
    """A second copy of the adapter for the expected answers: the server's own model runs on its worker thread."""
    return load_model(adapter_dir)


@pytest.fixture(scope="module")
def server(adapter_dir, tokenizer, template):
    engine = ChatEngine(load_model(adapter_dir), tokenizer, template, cache_budget_bytes=64 * 2**20)
    with serving_in_thread(build_app(engine, NAME)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)


def render(tokenizer, template, messages):
    return tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False)


def reference_chat(model, tokenizer, template, user_turns, max_tokens=MAX_TOKENS):
    """Expected (answer, cached_tokens) per turn: docs/generation.md's chat continuation, greedy. Each later turn's
    input is the previous output sequence, then the tokens of the text the template adds after the previous answer."""
    messages, output, kept_text, results = [], None, None, []
    for turn in user_turns:
        messages.append({"role": "user", "content": turn})
        text = render(tokenizer, template, messages)
        settings = dict(max_new_tokens=max_tokens, do_sample=False, return_dict_in_generate=True)
        if output is None:
            input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
            cache, cached = None, 0
        else:
            assert text.startswith(kept_text)
            new = tokenizer(text[len(kept_text) :], add_special_tokens=False, return_tensors="pt")["input_ids"]
            input_ids, cache = torch.cat([output.sequences, new], dim=1), compat.output_cache(output)
            cached = cache.get_seq_length()
        output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), cache=cache,
                                **settings)
        answer_ids = output.sequences[0, input_ids.shape[1] :]
        answer = tokenizer.decode(answer_ids, skip_special_tokens=True)
        kept_text = text + tokenizer.decode(answer_ids, skip_special_tokens=False)
        messages.append({"role": "assistant", "content": answer})
        results.append((answer, cached))
    return results


def full_prefill_answer(model, tokenizer, template, messages, max_tokens=MAX_TOKENS):
    ids = tokenizer(render(tokenizer, template, messages), add_special_tokens=False, return_tensors="pt")["input_ids"]
    output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                            do_sample=False)
    return tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)


def server_chat(client, user_turns, max_tokens=MAX_TOKENS, stream_last=False):
    """(answer, cached_tokens) per turn from the server, each turn sending the whole conversation so far."""
    messages, results = [], []
    for i, turn in enumerate(user_turns):
        messages.append({"role": "user", "content": turn})
        if stream_last and i == len(user_turns) - 1:
            answer, usage, _ = streamed(client, messages, max_tokens)
        else:
            response = client.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens,
                                                      temperature=0)
            answer, usage = response.choices[0].message.content, response.usage
        messages.append({"role": "assistant", "content": answer})
        results.append((answer, usage.prompt_tokens_details.cached_tokens))
    return results


def streamed(client, messages, max_tokens=MAX_TOKENS, **settings):
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens, temperature=0,
                                                 stream=True, **settings))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    return text, chunks[-1].usage, finish


def post_raw(url, body: bytes, path="/v1/chat/completions"):
    request = urllib.request.Request(url + path, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def get_json(url, path):
    with urllib.request.urlopen(url + path, timeout=REQUEST_TIMEOUT_S) as response:
        return json.loads(response.read())


def test_a_two_turn_chat_equals_generate_with_the_chat_continuation(client, reference_model, tokenizer, template):
    turns = [STORIES[0], FOLLOW_UPS[0]]
    expected = reference_chat(reference_model, tokenizer, template, turns)
    assert server_chat(client, turns) == expected
    assert expected[1][1] > 0  # the second turn read only its new tokens over the kept cache


def test_streaming_equals_non_streaming(client, tokenizer, template):
    turns = [STORIES[1], FOLLOW_UPS[1]]
    plain = server_chat(client, turns)
    streamed_last = server_chat(client, turns, stream_last=True)  # the same first turn again, then a streamed reuse
    assert streamed_last == plain and plain[1][1] > 0
    answer = plain[0][0]
    assert len(answer) > 3, "the stop-string check below needs a longer answer"
    stop = answer[2:4]
    messages = [{"role": "user", "content": STORIES[1]}]
    cut = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert cut.choices[0].message.content == answer[: answer.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    text, _, finish = streamed(client, messages, stop=[stop])
    assert (text, finish) == (cut.choices[0].message.content, ["stop"])


def test_eight_concurrent_clients_three_turns_each_get_their_own_answers(client, reference_model, tokenizer, template):
    conversations = [[story, *FOLLOW_UPS] for story in STORIES]
    expected = [reference_chat(reference_model, tokenizer, template, turns) for turns in conversations]
    assert len({tuple(answer for answer, _ in turns) for turns in expected}) > 1, (
        "answers must differ to show cross-talk"
    )
    results: list = [None] * len(conversations)

    def talk(i):
        results[i] = server_chat(client, conversations[i])

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(len(conversations))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=REQUEST_TIMEOUT_S)
    assert results == expected
    assert all(cached > 0 for turns in results for _, cached in turns[1:])


def test_an_edited_history_gets_a_full_prefill_not_the_kept_cache(client, reference_model, tokenizer, template):
    first = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": STORIES[2]}],
                                           max_tokens=MAX_TOKENS, temperature=0)
    edited = [{"role": "user", "content": STORIES[2]},
              {"role": "assistant", "content": "(edited) " + first.choices[0].message.content},
              {"role": "user", "content": FOLLOW_UPS[0]}]
    response = client.chat.completions.create(model=NAME, messages=edited, max_tokens=MAX_TOKENS, temperature=0)
    assert response.usage.prompt_tokens_details.cached_tokens == 0
    assert response.choices[0].message.content == full_prefill_answer(reference_model, tokenizer, template, edited)


def test_a_dropped_conversation_gets_a_full_prefill(adapter_dir, reference_model, tokenizer, template):
    engine = ChatEngine(load_model(adapter_dir), tokenizer, template, cache_budget_bytes=1)  # keeps nothing
    with serving_in_thread(build_app(engine, NAME)) as url:
        small = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        turns = [STORIES[3], FOLLOW_UPS[0]]
        results = server_chat(small, turns)
    assert [cached for _, cached in results] == [0, 0]
    messages = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": results[0][0]},
                {"role": "user", "content": turns[1]}]
    assert results[1][0] == full_prefill_answer(reference_model, tokenizer, template, messages)


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client):
    url, engine = server
    good = {"model": NAME, "messages": [{"role": "user", "content": "Ask: hi?"}], "max_tokens": 2}
    cases = [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (json.dumps({**good, "model": "gpt-4o"}).encode(), 404),
        (json.dumps({**good, "messages": []}).encode(), 400),
        (json.dumps({**good, "n": 2}).encode(), 400),
        (json.dumps({**good, "tools": [{"type": "function"}]}).encode(), 400),
        (json.dumps({**good, "temperature": 3}).encode(), 400),
        (json.dumps({**good, "max_tokens": 0}).encode(), 400),
        (json.dumps({**good, "stop": ["a", "b", "c", "d", "e"]}).encode(), 400),
        (json.dumps({**good, "messages": [{"role": "robot", "content": "x"}]}).encode(), 400),
        (json.dumps({**good, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(), 400),
        (json.dumps({**good, "messages": [{"role": "user", "content": "a b c " * 200}]}).encode(), 400),
        (json.dumps({**good, "max_tokens": engine.max_positions}).encode(), 400),
    ]
    for body, status in cases:
        code, answer = post_raw(url, body)
        assert code == status, (body[:80], answer)
        assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["message"]
    assert post_raw(url, b"{}", path="/v1/nothing-here")[0] == 404
    with pytest.raises(openai.BadRequestError, match="context length") as error:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x " * 300}], max_tokens=2)
    assert error.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=good["messages"], max_tokens=2)
    assert client.chat.completions.create(**good).choices[0].message.content is not None
    assert [model.id for model in client.models.list()] == [NAME]
    assert get_json(url, "/health")["status"] == "ok"


def leave_stream(url, body, wait_for_content: bool) -> None:
    """Open a streaming request, read its first event (or its first answer text) and disconnect."""
    address = urlparse(url)
    connection = http.client.HTTPConnection(address.hostname, address.port, timeout=REQUEST_TIMEOUT_S)
    connection.request(
        "POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200
    while (line := response.fp.readline()) and not (line.startswith(b"data:") and (
            not wait_for_content or b'"content"' in line)):
        pass
    assert line, "the stream ended before the client left"
    connection.sock.shutdown(2)
    connection.close()


def wait_for_cancelled_streams(url, count: int) -> dict:
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while (health := get_json(url, "/health"))["cancelled_streams"] < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return health


def test_a_client_that_leaves_a_stream_frees_its_work(adapter_dir, tokenizer, template):
    model = load_model(adapter_dir)
    model.generation_config.eos_token_id = None  # answers always run to max_tokens, unless stopped
    engine = ChatEngine(model, tokenizer, template, cache_budget_bytes=64 * 2**20)
    messages = [{"role": "user", "content": STORIES[4]}]
    body = {"model": NAME, "messages": messages, "max_tokens": 150, "temperature": 0, "stream": True}
    with serving_in_thread(build_app(engine, NAME)) as url:
        release = threading.Event()
        # The worker is busy: the next request waits in the queue.
        busy = engine.worker.submit(release.wait, REQUEST_TIMEOUT_S)
        leave_stream(url, body, wait_for_content=False)
        assert wait_for_cancelled_streams(url, 1)["cancelled_streams"] == 1
        release.set()
        busy.result(timeout=REQUEST_TIMEOUT_S)
        leave_stream(url, body, wait_for_content=True)  # this time the client leaves while the answer is generated
        assert wait_for_cancelled_streams(url, 2)["cancelled_streams"] == 2
        left = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        after = left.chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0)
        assert after.choices[0].finish_reason == "length" and after.usage.completion_tokens == 3
        # Only this last conversation is kept: the queued request never ran, and the other one was aborted (a
        # finished answer would have been kept).
        assert get_json(url, "/health")["kept_conversations"] == 1


def test_seeded_sampling_repeats_and_max_completion_tokens_bounds_the_answer(client):
    messages = [{"role": "user", "content": STORIES[5]}]
    settings = dict(model=NAME, messages=messages, max_completion_tokens=5, temperature=1.5, top_p=0.95, seed=11)
    first, second = (client.chat.completions.create(**settings) for _ in range(2))
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.usage.completion_tokens <= 5
    others = {client.chat.completions.create(**{**settings, "seed": seed}).choices[0].message.content
              for seed in range(12, 16)}
    assert len(others | {first.choices[0].message.content}) > 1  # the seed matters: this really samples


def test_the_command_refuses_to_start_without_a_chat_template(adapter_dir):
    from peft_bitune.serving import cli

    with pytest.raises(SystemExit, match="--chat-template"):
        cli.main(["--model", BASE, "--adapter", adapter_dir, "--port", "0"])


@pytest.mark.slow  # a fresh Python process imports torch, transformers and FastAPI: about half a minute on 2 cores
def test_the_command_serves_the_adapter(adapter_dir):
    command = [sys.executable, "-m", "peft_bitune.serving.cli", "--model", BASE, "--adapter", adapter_dir,
               "--chat-template", TEMPLATE_FILE, "--port", "0", "--served-model-name", NAME]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = process.stdout.readline()
        assert "serving" in line, line
        url = line.split(" on ")[-1].strip()
        assert url.startswith("http://127.0.0.1:")
        cli_client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
        response = cli_client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": STORIES[0]}],
                                                      max_tokens=2, temperature=0)
        assert response.usage.completion_tokens <= 2
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_stop_strings_are_cut_the_same_whole_or_streamed():
    assert cut_at_stop("Answer: soup", [": s", "xx"]) == ("Answer", True)
    assert cut_at_stop("Answer", ["xx"]) == ("Answer", False)
    for pieces in (["Ans", "wer:", " s", "oup"], ["A", "n", "s", "w", "e", "r", ":", " ", "s"], ["Answer: soup"]):
        stream = StopTextFilter([": s", "er!"])
        assert "".join(stream.feed(piece) for piece in pieces) + stream.flush() == "Answer"
    stream = StopTextFilter(["er!"])
    assert "".join(stream.feed(piece) for piece in ["Answ", "er", "?"]) + stream.flush() == "Answer?"


def fake_conversation(text: str, tokens: int) -> KeptConversation:
    cache = BituneCache()
    cache.update(torch.zeros(1, 1, tokens - 1, 2), torch.zeros(1, 1, tokens - 1, 2), 0)
    cache.record_conversation(torch.arange(tokens)[None], torch.ones(1, tokens, dtype=torch.long))
    return KeptConversation(text, list(range(tokens)), cache)


def test_the_store_continues_only_exact_extensions_and_drops_the_least_recent():
    one = fake_conversation("<u>a</s>", 5)  # 4 positions x 2 x 2 floats = 64 bytes
    store = ConversationStore(max_bytes=2 * one.nbytes)
    store.keep(one)
    store.keep(fake_conversation("<u>b</s>", 5))
    assert store.take("<u>c</s><u>d") is None  # another history
    assert store.take("<u>a</s>") is None  # no new text
    assert store.keep(fake_conversation("<u>c</s>", 5))  # the budget drops the least recently kept, "<u>a"
    assert store.take("<u>a</s><u>x") is None
    assert store.take("<u>b</s><u>x").text == "<u>b</s>"
    assert store.take("<u>b</s><u>x") is None  # taken: the request that continues it owns the cache
    assert not store.keep(fake_conversation("<u>long</s>", 20))  # larger than the whole budget: not kept
    assert len(store) == 1 and store.nbytes == one.nbytes
    with pytest.raises(ValueError, match="stands for"):
        KeptConversation("x", [1, 2], fake_conversation("x", 5).cache)


def test_the_stream_decodes_incrementally_exactly_as_the_whole_answer(tokenizer):
    text = "héllo wörld 日本 </s>, done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = []
    stream = TextStream(tokenizer, pieces.append)
    stream.put(torch.tensor([[1, 2, 3]]))  # the prompt: not streamed
    for token in ids:
        stream.put(torch.tensor([token]))
    stream.end()
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in piece for piece in pieces)  # a character split over tokens waits for its last byte
    assert len(pieces) > 5  # piece by piece, not at the end


def test_the_worker_runs_jobs_in_order_and_survives_their_errors():
    from peft_bitune.serving.worker import ModelWorker

    worker = ModelWorker()
    release, order = threading.Event(), []
    blocked = worker.submit(release.wait, REQUEST_TIMEOUT_S)
    skipped = worker.submit(order.append, "cancelled")
    failing = worker.submit(lambda: 1 / 0)
    last = worker.submit(lambda: order.append("last") or "done")
    assert skipped.cancel()  # still queued: it never runs
    release.set()
    assert blocked.result(REQUEST_TIMEOUT_S) is True
    with pytest.raises(ZeroDivisionError):
        failing.result(REQUEST_TIMEOUT_S)
    assert last.result(REQUEST_TIMEOUT_S) == "done" and order == ["last"]
    worker.close(REQUEST_TIMEOUT_S)
    with pytest.raises(RuntimeError, match="stopped"):
        worker.submit(print)
