"""`bitune-serve` answers waiting requests in batches, and a request's answer does not depend on its batch: greedy
answers in a batch of 8 equal each request answered alone (new conversations and continued ones, with different
lengths), a seeded request keeps its random stream, streams stay per request, and the limits hold (fixtures in
conftest.py; the reference is `FullPrefill`, each request alone in the test's thread)."""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

openai = pytest.importorskip("openai", reason="the serving tests need the `serve` extra")
pytest.importorskip("fastapi", reason="the serving tests need the `serve` extra")

from peft_bitune.serving.app import ChatCompletions, build_app  # noqa: E402
from peft_bitune.serving.engine import ChatEngine  # noqa: E402
from peft_bitune.serving.server import serving_in_thread  # noqa: E402
from peft_bitune.serving.settings import BatchLimits  # noqa: E402
from peft_bitune.serving.worker import ModelWorker  # noqa: E402
from serving_helpers import (  # noqa: E402
    FOLLOW_UPS,
    NAME,
    REQUEST_TIMEOUT_S,
    STORIES,
    assistant,
    load_model,
    user,
)
from test_serving import client_of, leave_stream, wait_for_cancelled_streams  # noqa: E402


@pytest.fixture(scope="module")
def engine(serving_adapter, serving_tokenizer, serving_template):
    return ChatEngine(load_model(serving_adapter), serving_tokenizer, serving_template, 64 * 2**20)


def body(messages: list[dict], max_tokens: int, **fields) -> dict:
    return {"model": NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **fields}


def answer_together(engine: ChatEngine, bodies: list[dict]) -> list:
    """Queue every request while the worker is busy, then let it go: the results, and the batch sizes it ran."""
    requests = ChatCompletions(engine, NAME)
    before = engine.worker.batch_sizes.copy()
    release = threading.Event()
    busy = engine.worker.submit(release.wait, REQUEST_TIMEOUT_S)
    futures = [engine.submit(requests.chat_request(b)) for b in bodies]
    release.set()
    busy.result(REQUEST_TIMEOUT_S)
    results = [future.result(REQUEST_TIMEOUT_S) for future in futures]
    return results, sorted((engine.worker.batch_sizes - before).elements())


def test_a_greedy_answer_is_the_same_alone_and_in_a_batch_of_eight(engine, full_prefill):
    """Eight new conversations of different lengths, answers of different lengths, in one batch; then eight continued
    ones (four kept conversations and four new), again in one batch: each equals its request answered alone."""
    first = [body([user(story)], max_tokens=3 + i) for i, story in enumerate(STORIES)]
    results, batches = answer_together(engine, first)
    assert batches == [8]
    assert len({len(full_prefill.requests.chat_request(b).prompt) for b in first}) > 4  # different lengths
    for request, result in zip(first, results):
        alone = full_prefill.engine.run(full_prefill.requests.chat_request(request))
        assert (result.answer_ids, result.content, result.finish_reason) == (
            alone.answer_ids, alone.content, alone.finish_reason)
        assert result.cached_tokens == 0
    continued = [body([*b["messages"], assistant(r.content), user(FOLLOW_UPS[i % 2])], max_tokens=8 - i)
                 for i, (b, r) in enumerate(zip(first[:4], results[:4]))]
    new = [body([user(story), assistant("no"), user(FOLLOW_UPS[0])], max_tokens=4, user="another client")
           for story in STORIES[4:]]  # another partition: nothing kept to reuse
    mixed = continued + new
    results_2, batches = answer_together(engine, mixed)
    assert batches == [8]
    for request, result in zip(mixed, results_2):
        alone = full_prefill.engine.run(full_prefill.requests.chat_request(request))
        assert (result.answer_ids, result.finish_reason) == (alone.answer_ids, alone.finish_reason)
    # The continued ones read only their new turn (all but the previous answer's last token came from the kept cache).
    assert [r.cached_tokens for r in results_2] == [
        r.prompt_tokens + len(r.answer_ids) - 1 for r in results[:4]] + [0] * 4
    # Kept caches own exactly their bytes (copies, not views of the batch), within the budget.
    for kept in engine.store._kept.values():
        keys = kept.cache.layers[0].keys
        assert keys.untyped_storage().nbytes() == keys.numel() * keys.element_size()
    assert engine.store.nbytes <= engine.store.max_bytes


def test_a_seeded_request_keeps_its_random_stream_whatever_waits_with_it(engine, full_prefill):
    sampled = dict(temperature=1.5, top_p=0.95, seed=7)
    seeded = body([user(STORIES[5])], max_tokens=6, **sampled)
    others = [body([user(story)], max_tokens=4) for story in STORIES[:3]]
    results, batches = answer_together(engine, [*others[:2], seeded, others[2]])
    assert batches == [1, 3]  # the seeded request alone, the greedy ones together
    alone = full_prefill.engine.run(full_prefill.requests.chat_request(seeded))
    assert results[2].answer_ids == alone.answer_ids
    unseeded = {key: value for key, value in seeded.items() if key != "seed"}
    # Unseeded sampling batches with the same settings only, never with greedy requests.
    _, batches = answer_together(engine, [unseeded, others[0], unseeded, {**unseeded, "temperature": 1.0}])
    assert batches == [1, 1, 2]


def test_a_request_larger_than_the_token_budget_is_answered_alone(serving_adapter, serving_tokenizer,
                                                                 serving_template, full_prefill):
    limits = BatchLimits(max_batch_size=8, max_batch_tokens=60)
    small = ChatEngine(load_model(serving_adapter), serving_tokenizer, serving_template, 0, limits)
    large = body([user(STORIES[1])], max_tokens=5)  # about 40 tokens: two of them do not fit in 60
    assert len(full_prefill.requests.chat_request(large).prompt) + 5 > limits.max_batch_tokens // 2
    results, batches = answer_together(small, [large, large, large])
    assert batches == [1, 1, 1]
    assert all(r.answer_ids == full_prefill.result(large["messages"], 5).answer_ids for r in results)
    tiny = BatchLimits(max_batch_size=8, max_batch_tokens=1)  # smaller than any request: each alone, none refused
    smallest = ChatEngine(small.model, serving_tokenizer, serving_template, 0, tiny)
    results, batches = answer_together(smallest, [large, large])
    assert batches == [1, 1] and all(r.finish_reason for r in results)
    with pytest.raises(ValueError, match="`max_batch_size` must be at least 1, got 0"):
        BatchLimits(max_batch_size=0)


def test_a_short_answer_is_delivered_when_its_row_ends_not_when_its_batch_does(
    serving_adapter, serving_tokenizer, serving_template
):
    model = load_model(serving_adapter)
    model.generation_config.eos_token_id = None  # answers run to max_tokens
    engine = ChatEngine(model, serving_tokenizer, serving_template, 64 * 2**20)
    requests = ChatCompletions(engine, NAME)
    short, long = body([user(STORIES[0])], max_tokens=2), body([user(STORIES[1])], max_tokens=40)
    release = threading.Event()
    busy = engine.worker.submit(release.wait, REQUEST_TIMEOUT_S)
    futures = [engine.submit(requests.chat_request(b)) for b in (short, long)]
    release.set()
    busy.result(REQUEST_TIMEOUT_S)
    answer = futures[0].result(REQUEST_TIMEOUT_S)
    assert not futures[1].done()  # 38 decoding steps to go
    assert len(futures[1].result(REQUEST_TIMEOUT_S).answer_ids) == 40
    assert answer.answer_ids == engine.run(requests.chat_request(short)).answer_ids
    assert engine.worker.batch_sizes == {2: 1}


def test_streams_in_one_batch_stay_apart_and_a_client_that_leaves_frees_its_row(
    serving_adapter, serving_tokenizer, serving_template
):
    """Three streamed requests in one batch: the row whose client leaves ends at its next token and is not kept;
    the others stream their own answers whole."""
    model = load_model(serving_adapter)
    model.generation_config.eos_token_id = None  # answers run to max_tokens unless stopped
    engine = ChatEngine(model, serving_tokenizer, serving_template, 64 * 2**20)
    reference = ChatEngine(model, serving_tokenizer, serving_template, 0)
    staying = [body([user(STORIES[i])], max_tokens=4 + i, stream=True) for i in (0, 2)]
    leaving = body([user(STORIES[4])], max_tokens=150, stream=True)
    with serving_in_thread(build_app(engine, NAME)) as url:
        client = client_of(url)
        release = threading.Event()
        busy = engine.worker.submit(release.wait, REQUEST_TIMEOUT_S)
        wait_until(busy.running)
        texts: dict[int, str] = {}

        def stream(index: int) -> None:
            fields = {k: v for k, v in staying[index].items() if k != "stream"}
            chunks = client.chat.completions.create(**fields, stream=True)
            texts[index] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        leaver = threading.Thread(target=leave_stream, args=(url, leaving, True))
        leaver.start()
        wait_until(lambda: engine.worker.pending() == 3)
        release.set()
        busy.result(REQUEST_TIMEOUT_S)
        for thread in [*threads, leaver]:
            thread.join(REQUEST_TIMEOUT_S)
        health = wait_for_cancelled_streams(url, 1)
    assert health["batch_sizes"] == {"3": 1} and health["cancelled_streams"] == 1
    assert health["kept_conversations"] == 2  # the two finished answers; not the one cut short
    for index, request in enumerate(staying):
        expected = reference.run(ChatCompletions(reference, NAME).chat_request({**request, "stream": False}))
        assert texts[index] == expected.content


def test_a_request_answered_on_the_callers_thread_waits_for_the_batch_the_worker_is_still_finishing(
    serving_adapter, serving_tokenizer, serving_template, full_prefill
):
    """A batch hands each row's result over as soon as the row ends, from inside `generate`, whose exit then routes
    the adapter's layers back to the weight set they had: `run` on another thread must not use the model before the
    batch has ended, or its prompt passes run partly with the wrong weight set. Here the worker is held right after
    it handed over the batch's last result, until the caller has had time to reach the model (it must not)."""
    engine = ChatEngine(load_model(serving_adapter), serving_tokenizer, serving_template, 0)
    requests = ChatCompletions(engine, NAME)
    bodies = [body([user(story)], max_tokens=3) for story in STORIES[:2]]
    alone = requests.chat_request(body([user(STORIES[2])], max_tokens=4))
    answered: list = []
    caller = threading.Thread(target=lambda: answered.append(engine.run(alone)))
    held, caller_in_model, entered_while_held = threading.Event(), threading.Event(), []

    def note_caller(module, args) -> None:
        if threading.current_thread() is caller:
            entered_while_held.append(held.is_set())
            caller_in_model.set()

    def hold_the_worker(_) -> None:  # a done-callback: runs on the worker, as it hands a row's result over
        if all(future.done() for future in futures):  # the batch's last result: the worker is still in `generate`
            held.set()
            caller.start()
            caller_in_model.wait(3)  # time to reach the model, had it not to wait for this batch
            held.clear()

    hook = engine.model.get_input_embeddings().register_forward_pre_hook(note_caller)
    try:
        release = threading.Event()
        busy = engine.worker.submit(release.wait, REQUEST_TIMEOUT_S)
        futures = [engine.submit(requests.chat_request(b)) for b in bodies]
        for future in futures:
            future.add_done_callback(hold_the_worker)
        release.set()
        busy.result(REQUEST_TIMEOUT_S)
        results = [future.result(REQUEST_TIMEOUT_S) for future in futures]
        wait_until(lambda: caller.ident is not None)  # started by the worker, after it set the results
        caller.join(REQUEST_TIMEOUT_S)
    finally:
        hook.remove()
        engine.close()
    assert engine.worker.batch_sizes == {2: 1}
    assert entered_while_held and not any(entered_while_held), "the caller ran the model inside the worker's batch"
    assert answered[0].answer_ids == full_prefill.engine.run(alone).answer_ids
    for request, result in zip(bodies, results):
        assert result.answer_ids == full_prefill.result(request["messages"], 3).answer_ids


def wait_until(condition, timeout: float = REQUEST_TIMEOUT_S) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        done.wait(0.02)
    raise AssertionError("timed out")


class Pairs:
    """A batcher that lets items of equal parity share a batch of at most two, and answers each with its double."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def can_join(self, batch: list[int], item: int) -> bool:
        return len(batch) < 2 and item % 2 == batch[0] % 2

    def run_batch(self, items: list[int], deliver) -> list:
        self.batches.append(items)
        deliver(0, "early")  # handed over before the batch ends; the result returned later is not set again
        return [ValueError(item) if item < 0 else 2 * item for item in items]


def test_the_worker_batches_what_waits_behind_the_head_and_keeps_the_order_of_the_rest():
    worker, batcher, release = ModelWorker(), Pairs(), threading.Event()
    busy = worker.submit(release.wait, REQUEST_TIMEOUT_S)
    futures: list[Future] = [worker.submit_item(batcher, item) for item in (1, 2, 3, 5, -2, 4)]
    assert futures[3].cancel()  # still queued: never answered
    wait_until(busy.running)
    assert worker.pending() == 6
    release.set()
    busy.result(REQUEST_TIMEOUT_S)
    assert futures[0].result(REQUEST_TIMEOUT_S) == "early" and futures[2].result(REQUEST_TIMEOUT_S) == 6
    assert futures[5].result(REQUEST_TIMEOUT_S) == "early"
    with pytest.raises(ValueError):
        futures[4].result(REQUEST_TIMEOUT_S)  # one failed item; the others of its batch stand
    worker.close(REQUEST_TIMEOUT_S)
    # The head always starts the next batch, with what may join it; 5 was cancelled, so it never ran.
    assert batcher.batches == [[1, 3], [2, -2], [4]]
    assert sorted(worker.batch_sizes.elements()) == [1, 2, 2]
    assert worker.batch_size_counts() == {"1": 1, "2": 2}  # as /health reports it
    with pytest.raises(RuntimeError, match="stopped"):
        worker.submit_item(batcher, 1)


# Requests of the precision check: every story, asked alone and with a follow-up (16 prompts of different lengths),
# answers of up to 32 tokens (with 8, bfloat16 measured no difference here).
PRECISION_REQUESTS = [body([user(story)], max_tokens=32) for story in STORIES] + [
    body([user(story), assistant("Answer: no"), user(FOLLOW_UPS[i % 2])], max_tokens=32)
    for i, story in enumerate(STORIES)
]


def batched_agreement(adapter: str, tokenizer, template: str, dtype: torch.dtype) -> tuple[int, int]:
    """(answers equal alone and in a batch, requests): `PRECISION_REQUESTS` answered greedily in batches of 8 and
    each alone, by the model in `dtype`, keeping nothing (every request a full prefill)."""
    engine = ChatEngine(load_model(adapter).to(dtype), tokenizer, template, 0)
    try:
        requests = ChatCompletions(engine, NAME)
        batched = []
        for start in range(0, len(PRECISION_REQUESTS), 8):
            results, batches = answer_together(engine, PRECISION_REQUESTS[start : start + 8])
            assert batches == [8]
            batched += results
        alone = [engine.run(requests.chat_request(request)) for request in PRECISION_REQUESTS]
        return sum(a.answer_ids == b.answer_ids for a, b in zip(alone, batched)), len(PRECISION_REQUESTS)
    finally:
        engine.close()


def test_in_float32_every_greedy_answer_is_the_same_alone_and_in_a_batch(serving_adapter, serving_tokenizer,
                                                                        serving_template):
    """The guarantee docs/serving.md makes for float32: all 16 answers identical (padding is masked, and float32
    leaves no near-tie to the different reduction order of a padded batch)."""
    assert batched_agreement(serving_adapter, serving_tokenizer, serving_template, torch.float32) == (16, 16)


def documented_bfloat16_floor() -> int:
    """The least agreement docs/serving.md promises for bfloat16 (of 16), read from its "Precision" paragraph."""
    text = (Path(__file__).parents[1] / "docs" / "serving.md").read_text(encoding="utf-8")
    floor = re.search(r"at\s+least\s+(\d+)\s+of\s+these\s+16\s+in\s+bfloat16", text)
    measured = re.search(r"(\d+)\s+of\s+16\s+answers\s+identical\s+in\s+bfloat16", text)
    assert floor and measured, "docs/serving.md must state the bfloat16 limit of batching, its rate and this floor"
    assert int(floor.group(1)) <= int(measured.group(1)) < 16
    return int(floor.group(1))


def test_in_bfloat16_batching_may_change_answers_within_the_documented_rate(serving_adapter, serving_tokenizer,
                                                                             serving_template):
    """In bfloat16 a padded batch sums in another order than a request alone, and a near-tie between two tokens can
    flip: docs/serving.md states the limit and the rate measured here; on any CPU the rate must stay at or above the
    floor it states (and the float32 test above stays exact)."""
    same, total = batched_agreement(serving_adapter, serving_tokenizer, serving_template, torch.bfloat16)
    assert same >= documented_bfloat16_floor(), (same, total)
