"""`bitune-serve` answers, talked to with the real `openai` client on 127.0.0.1: the same request gets the same answer
whatever the server kept (its kept conversation, a full prefill, a fresh server, a retry), and that answer is greedy
decoding with the training forward on the conversation laid out turn by turn. The miniature base with a random
(non-trivial) Bitune adapter, saved and loaded back (fixtures in conftest.py).
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from urllib.parse import urlparse

import pytest
import torch

openai = pytest.importorskip("openai", reason="the serving tests need the `serve` extra")
pytest.importorskip("fastapi", reason="the serving tests need the `serve` extra")

from transformers import AutoModelForCausalLM  # noqa: E402

from peft_bitune.serving import ConversationStore, KeptConversation  # noqa: E402
from peft_bitune.serving.app import ChatCompletions, build_app  # noqa: E402
from peft_bitune.serving.conversations import reusable_prefix  # noqa: E402
from peft_bitune.serving.engine import ChatEngine  # noqa: E402
from peft_bitune.serving.prompts import Prompt, PromptBuilder, PromptLayoutError  # noqa: E402
from peft_bitune.serving.server import serving_in_thread  # noqa: E402
from peft_bitune.serving.streaming import StopTextFilter, cut_at_stop  # noqa: E402
from peft_bitune.serving.validation import OpenAIError  # noqa: E402
from peft_bitune.tuner.caches import BituneCache  # noqa: E402
from reference import make_bitune  # noqa: E402
from serving_helpers import (  # noqa: E402
    BASE,
    FOLLOW_UPS,
    MAX_TOKENS,
    NAME,
    REQUEST_TIMEOUT_S,
    STORIES,
    ask,
    assistant,
    converse,
    get_json,
    greedy_by_the_training_forward,
    load_model,
    streamed_pieces,
    user,
)


def client_of(url: str, api_key: str = "unused"):
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=REQUEST_TIMEOUT_S)


@pytest.fixture(scope="module")
def server(serving_adapter, serving_tokenizer, serving_template):
    engine = ChatEngine(load_model(serving_adapter), serving_tokenizer, serving_template, 64 * 2**20)
    with serving_in_thread(build_app(engine, NAME)) as url:
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return client_of(server[0])


def test_the_same_request_gets_the_same_answer_whatever_the_server_kept(
    server, client, full_prefill, serving_adapter, serving_tokenizer, serving_template
):
    """Three turns, each answered from the kept conversation, by a full prefill, on a retry, and (the last one) by a
    fresh server; all equal greedy decoding with the training forward on the conversation laid out turn by turn."""
    eos_ids = {serving_tokenizer.eos_token_id}
    messages, previous = [], None
    for number, turn in enumerate([STORIES[0], *FOLLOW_UPS]):
        messages.append(user(turn))
        kept, prompt_tokens, cached = ask(client, messages)
        retried, _, cached_on_retry = ask(client, messages)
        reference = full_prefill.result(messages)
        prompt = full_prefill.requests.chat_request(
            {"model": NAME, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}).prompt
        by_forward = greedy_by_the_training_forward(full_prefill.engine.model, prompt, MAX_TOKENS, eos_ids)
        assert reference.answer_ids == by_forward
        assert kept == retried == reference.content
        # The kept conversation held everything before this turn but the previous answer's last token, which is read
        # again; a retry holds all of its prompt but the last token, which decoding reads.
        assert cached == (0 if previous is None else previous.prompt_tokens + len(previous.answer_ids) - 1)
        assert cached_on_retry == prompt_tokens - 1 == reference.prompt_tokens - 1
        messages.append(assistant(kept))
        previous = reference
    engine = ChatEngine(load_model(serving_adapter), serving_tokenizer, serving_template, 64 * 2**20)
    with serving_in_thread(build_app(engine, NAME)) as url:
        fresh, _, cached = ask(client_of(url), messages[:-1])
    assert (fresh, cached) == (messages[-1]["content"], 0)


def test_an_answer_the_client_shortened_reuses_the_part_it_shares(client, full_prefill):
    """Partial reuse: the kept answer is cropped where the client's copy of it ends (a stripped or cut answer, or a
    template that writes it otherwise); the answer is the full prefill's."""
    first = [user(STORIES[1])]
    answer, prompt_tokens, _ = ask(client, first)
    whole = full_prefill.result(first)
    assert answer == whole.content and len(whole.answer_ids) > 2
    shortened = [*first, assistant(answer[: len(answer) // 2]), user(FOLLOW_UPS[0])]
    again, _, cached = ask(client, shortened)
    assert prompt_tokens < cached < prompt_tokens + len(whole.answer_ids) - 1
    assert again == full_prefill.answer(shortened)


def test_an_edited_answer_reuses_only_what_precedes_it(client, full_prefill):
    answer, prompt_tokens, _ = ask(client, [user(STORIES[2])])
    edited = [user(STORIES[2]), assistant("(edited) " + answer), user(FOLLOW_UPS[0])]
    again, _, cached = ask(client, edited)
    assert cached == prompt_tokens  # the first instruction, not a token of the answer
    assert again == full_prefill.answer(edited)


def test_a_history_adapter_reads_the_whole_conversation_as_one_instruction(
    tmp_path, serving_tokenizer, serving_template
):
    """`multi_turn="history"`: every request is a full prefill of the whole conversation as one instruction (what
    `generate` without a cache does); no turn continues a kept one, only a retry of the same request reuses it."""
    make_bitune(AutoModelForCausalLM.from_pretrained(BASE), seed=5, multi_turn="history").save_pretrained(tmp_path)
    engine = ChatEngine(load_model(str(tmp_path)), serving_tokenizer, serving_template, 64 * 2**20)
    with serving_in_thread(build_app(engine, NAME)) as url:
        history_client = client_of(url)
        messages = [user(STORIES[3])]
        first, _, _ = ask(history_client, messages)
        messages += [assistant(first), user(FOLLOW_UPS[0])]
        second, prompt_tokens, cached = ask(history_client, messages)
        retried, _, cached_on_retry = ask(history_client, messages)
    text = serving_tokenizer.apply_chat_template(messages, chat_template=serving_template, add_generation_prompt=True,
                                                 tokenize=False)
    ids = serving_tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    output = load_model(str(tmp_path)).generate(input_ids=ids, max_new_tokens=MAX_TOKENS, do_sample=False)
    assert second == retried == serving_tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True)
    assert (cached, cached_on_retry) == (0, prompt_tokens - 1)


def streamed(client, messages, max_tokens=MAX_TOKENS, **settings):
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=max_tokens, temperature=0,
                                                 stream=True, **settings))
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    return text, chunks[-1].usage, finish


def test_streaming_equals_non_streaming(client):
    plain = converse(client, [STORIES[1], FOLLOW_UPS[1]])
    messages = [user(STORIES[1]), assistant(plain[0][0]), user(FOLLOW_UPS[1])]
    text, usage, finish = streamed(client, messages)  # a retry of the last turn, streamed
    assert (text, usage.prompt_tokens) == plain[1][:2] and usage.prompt_tokens_details.cached_tokens == plain[1][1] - 1
    assert finish in (["stop"], ["length"])
    answer = plain[0][0]
    assert len(answer) > 3, "the stop-string check below needs a longer answer"
    stop = answer[2:4]
    messages = [user(STORIES[1])]
    cut = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert cut.choices[0].message.content == answer[: answer.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    text, _, finish = streamed(client, messages, stop=[stop])
    assert (text, finish) == (cut.choices[0].message.content, ["stop"])


def expected_conversation(full_prefill, user_turns):
    """The answers of a conversation, each turn a full prefill of the conversation so far."""
    messages, answers = [], []
    for turn in user_turns:
        messages.append(user(turn))
        answers.append(full_prefill.answer(messages))
        messages.append(assistant(answers[-1]))
    return answers


def test_eight_concurrent_clients_three_turns_each_get_their_own_answers(client, full_prefill):
    conversations = [[story, *FOLLOW_UPS] for story in STORIES]
    expected = [expected_conversation(full_prefill, turns) for turns in conversations]
    assert len({tuple(answers) for answers in expected}) > 1, "answers must differ to show cross-talk"
    results: list = [None] * len(conversations)

    def talk(i):
        results[i] = converse(client, conversations[i])

    threads = [threading.Thread(target=talk, args=(i,)) for i in range(len(conversations))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=REQUEST_TIMEOUT_S)
    assert [[answer for answer, _, _ in turns] for turns in results] == expected
    assert all(cached > 0 for turns in results for _, _, cached in turns[1:])


def test_a_dropped_conversation_gets_a_full_prefill(
    serving_adapter, serving_tokenizer, serving_template, full_prefill
):
    engine = ChatEngine(load_model(serving_adapter), serving_tokenizer, serving_template, cache_budget_bytes=1)
    with serving_in_thread(build_app(engine, NAME)) as url:
        results = converse(client_of(url), [STORIES[3], FOLLOW_UPS[0]])
    assert [cached for _, _, cached in results] == [0, 0]
    assert [answer for answer, _, _ in results] == expected_conversation(full_prefill, [STORIES[3], FOLLOW_UPS[0]])


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


def test_a_client_that_leaves_a_stream_frees_its_work(serving_adapter, serving_tokenizer, serving_template):
    model = load_model(serving_adapter)
    model.generation_config.eos_token_id = None  # answers always run to max_tokens, unless stopped
    engine = ChatEngine(model, serving_tokenizer, serving_template, cache_budget_bytes=64 * 2**20)
    messages = [user(STORIES[4])]
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
        after = client_of(url).chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0)
        assert after.choices[0].finish_reason == "length" and after.usage.completion_tokens == 3
        # Only this last conversation is kept: the queued request never ran, and the other one was aborted (a
        # finished answer would have been kept).
        assert get_json(url, "/health")["kept_conversations"] == 1


def test_a_stopped_server_leaves_no_thread_behind(serving_adapter, serving_tokenizer, serving_template):
    """Requests are prepared on the server's thread pool, whose threads end with the server (a pool of the app's own,
    never shut down, left its threads behind each server)."""
    engine = ChatEngine(load_model(serving_adapter), serving_tokenizer, serving_template, cache_budget_bytes=0)
    before = set(threading.enumerate())
    with serving_in_thread(build_app(engine, NAME)) as url:
        client_of(url).chat.completions.create(model=NAME, messages=[user(STORIES[0])], max_tokens=1, temperature=0)
        assert set(threading.enumerate()) - before  # the server's thread, and the one that prepared the request
    deadline = time.monotonic() + 60  # they end as the server stops; the rest is a loaded machine's slack
    while (left := set(threading.enumerate()) - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.close()
    assert not left, left


def test_seeded_sampling_repeats_and_max_completion_tokens_bounds_the_answer(client):
    messages = [user(STORIES[5])]
    settings = dict(model=NAME, messages=messages, max_completion_tokens=5, temperature=1.5, top_p=0.95, seed=11)
    first, second = (client.chat.completions.create(**settings) for _ in range(2))
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.usage.completion_tokens <= 5
    others = {client.chat.completions.create(**{**settings, "seed": seed}).choices[0].message.content
              for seed in range(12, 16)}
    assert len(others | {first.choices[0].message.content}) > 1  # the seed matters: this really samples


def test_stop_strings_are_cut_the_same_whole_or_streamed():
    assert cut_at_stop("Answer: soup", [": s", "xx"]) == ("Answer", True)
    assert cut_at_stop("Answer", ["xx"]) == ("Answer", False)
    for pieces in (["Ans", "wer:", " s", "oup"], ["A", "n", "s", "w", "e", "r", ":", " ", "s"], ["Answer: soup"]):
        stream = StopTextFilter([": s", "er!"])
        assert "".join(stream.feed(piece) for piece in pieces) + stream.flush() == "Answer"
    stream = StopTextFilter(["er!"])
    assert "".join(stream.feed(piece) for piece in ["Answ", "er", "?"]) + stream.flush() == "Answer?"


def answer_texts(tokenizer, prompt: Prompt) -> list[str]:
    return [tokenizer.decode(prompt.token_ids[start:end]) for start, end, is_answer in prompt.segments() if is_answer]


def test_the_turns_are_found_from_the_templates_generation_markers_as_trl_finds_the_assistant_spans(
    serving_tokenizer, serving_template
):
    """The miniature template marks the assistant's content and the EOS token after it: the answers are transformers'
    assistant mask, the tokens TRL's `assistant_only_loss` trains."""
    tokenizer = serving_tokenizer
    messages = [{"role": "system", "content": "Be brief."}, user("hi"), assistant("a cat"), user("ok"), user("so?"),
                assistant(""), user("end")]
    prompt = PromptBuilder(tokenizer, serving_template, "alternating").build(messages)
    trl = tokenizer.apply_chat_template(messages, chat_template=serving_template, add_generation_prompt=True,
                                        tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert prompt.token_ids == list(trl["input_ids"])
    assert prompt.answer_mask() == [bool(m) for m in trl["assistant_masks"]]
    answers = answer_texts(tokenizer, prompt)
    assert answers == ["a cat</s>", "</s>"] and len(prompt.segment_ends) == 5
    history = PromptBuilder(tokenizer, serving_template, "history").build(messages)
    assert (history.token_ids, history.segment_ends) == (prompt.token_ids, (len(prompt),))


def test_a_conversation_that_opens_with_an_assistant_message_is_read_as_training_reads_it(
    full_prefill, serving_tokenizer, serving_template
):
    """BituneSFTTrainer trains conversations with TRL's assistant mask (`assistant_only_loss=True`, a template with
    `{% generation %}` markers): a leading assistant message is an answer, after the template's first tokens (BOS,
    the assistant's header), which are its instruction. The server gives that layout one answer: greedy decoding with
    the training forward on it."""
    tokenizer = serving_tokenizer
    messages = [assistant("Answer: 5"), user("Ask: Who is the youngest?")]
    prompt = PromptBuilder(tokenizer, serving_template, "alternating").build(messages)
    trl = tokenizer.apply_chat_template(messages, chat_template=serving_template, add_generation_prompt=True,
                                        tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert prompt.answer_mask() == [bool(m) for m in trl["assistant_masks"]]
    answers = answer_texts(tokenizer, prompt)
    assert answers == ["Answer: 5</s>"] and prompt.answer_mask()[0] is False
    empty = PromptBuilder(tokenizer, serving_template, "alternating").build([assistant(""), *messages[1:]])
    answers = answer_texts(tokenizer, empty)
    assert answers == ["</s>"]  # an empty leading answer is its EOS token
    by_forward = greedy_by_the_training_forward(full_prefill.engine.model, prompt, MAX_TOKENS,
                                                {tokenizer.eos_token_id})
    assert full_prefill.result(messages).answer_ids == by_forward


def test_an_assistant_message_with_nothing_before_it_to_read_is_refused(full_prefill, serving_tokenizer):
    """Training refuses a row that starts with an answer token (there is no instruction to read twice before it); a
    template that writes a leading assistant message first is refused with a 400 that says to start with a system or
    user message."""
    tokenizer = serving_tokenizer
    bare = ("{% for message in messages %}{% if message['role'] == 'assistant' %}"
            "{% if not loop.first %}<|assistant|>\n{% endif %}{% generation %}{{ message['content'] }}{{ eos_token }}"
            "{% endgeneration %}{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}{% endif %}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    opening = [assistant("Answer: 5"), user("Ask: Who?")]
    builder = PromptBuilder(tokenizer, bare, "alternating")
    builder.check()  # a conversation that opens with a user message is laid out
    with pytest.raises(PromptLayoutError, match="Start the conversation with a system or user message"):
        builder.build(opening)
    requests = ChatCompletions(ChatEngine(full_prefill.engine.model, tokenizer, bare, 0), NAME)
    with pytest.raises(OpenAIError, match="Start the conversation with a system or user message") as refused:
        requests.chat_request({"model": NAME, "messages": opening, "max_tokens": 2})
    assert refused.value.status == 400 and refused.value.param == "messages"


def fake_kept(token_ids: list[int], segment_ends: tuple[int, ...], partition=None) -> KeptConversation:
    """A kept conversation whose cache holds all but its last token (zeros: 4 bytes x 2 x 2 per position)."""
    cache = BituneCache()
    held = len(token_ids) - 1
    cache.update(torch.zeros(1, 1, held, 2), torch.zeros(1, 1, held, 2), 0)
    cache.record_conversation(torch.tensor([token_ids]), torch.ones(1, len(token_ids), dtype=torch.long))
    return KeptConversation(Prompt(token_ids, segment_ends), cache, partition)


def test_only_what_a_full_prefill_would_compute_is_reused():
    kept = Prompt([1, 2, 3, 4, 5], (3, 5))  # instruction 1 2 3, answer 4 5
    cases = {
        "the next turn": (Prompt([1, 2, 3, 4, 5, 6, 7], (3, 5, 7)), 5),
        "a retry": (Prompt([1, 2, 3], (3,)), 3),
        "a changed answer": (Prompt([1, 2, 3, 4, 9, 6], (3, 5, 6)), 4),
        "a shortened answer": (Prompt([1, 2, 3, 4, 6, 7], (3, 4, 6)), 4),
        "a longer answer": (Prompt([1, 2, 3, 4, 5, 8, 6], (3, 6, 7)), 5),
        "the instruction's last token changed": (Prompt([1, 2, 9, 4, 5, 6], (3, 5, 6)), 2),
        "a longer instruction": (Prompt([1, 2, 3, 4, 5, 6], (4, 5, 6)), 0),
        "the same tokens read as one instruction": (Prompt([1, 2, 3, 4, 5, 6], (6,)), 0),
        "another first token": (Prompt([7, 2, 3, 4, 5, 6], (3, 5, 6)), 0),
    }
    assert {name: reusable_prefix(kept, request) for name, (request, _) in cases.items()} == {
        name: expected for name, (_, expected) in cases.items()
    }
    # At most what the cache holds (all but the generated last token), and all of a prompt but its last token.
    conversation = fake_kept([1, 2, 3, 4, 5], (3, 5))
    assert conversation.reusable_length(cases["the next turn"][0]) == 4
    assert conversation.reusable_length(cases["a retry"][0]) == 2


def test_the_store_reuses_within_a_partition_and_drops_the_least_recent():
    one = fake_kept([1, 2, 3, 4, 5], (3, 5))  # 4 positions x 2 x 2 floats = 64 bytes
    store = ConversationStore(max_bytes=2 * one.nbytes)
    store.keep(one)
    store.keep(fake_kept([6, 2, 3, 4, 5], (3, 5), partition="someone else"))
    next_turn = Prompt([1, 2, 3, 4, 5, 8, 9], (3, 5, 7))
    assert store.take("nobody", next_turn) == (None, 0)
    assert store.take(None, Prompt([9, 9, 9], (3,))) == (None, 0)  # shares nothing
    assert store.keep(fake_kept([7, 2, 3, 4, 5], (3, 5)))  # the budget drops the least recently kept: `one`
    assert store.take(None, next_turn) == (None, 0)
    kept, length = store.take("someone else", Prompt([6, 2, 3, 4, 5, 8], (3, 5, 6)))
    assert (kept.prompt.token_ids, length) == ([6, 2, 3, 4, 5], 4)
    assert store.take("someone else", Prompt([6, 2, 3, 4, 5, 8], (3, 5, 6))) == (None, 0)  # taken: its request owns it
    assert not store.keep(fake_kept(list(range(20)), (10, 20)))  # larger than the whole budget: not kept
    assert len(store) == 1 and store.nbytes == one.nbytes
    with pytest.raises(ValueError, match="stands for"):
        KeptConversation(Prompt([1, 2], (1, 2)), fake_kept([1, 2, 3, 4, 5], (3, 5)).cache)




def test_the_stream_decodes_incrementally_exactly_as_the_whole_answer(serving_tokenizer):
    tokenizer = serving_tokenizer
    text = "héllo wörld 日本 </s>, done"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = streamed_pieces(tokenizer, ids)
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
