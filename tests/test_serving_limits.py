"""What one request can make `bitune-serve` do is bounded (docs/serving.md, "Limits"): its stop sequences (how many,
how long, each piece of text searched in bounded time, nothing kept after the request), and its conversation (a cheap
length bound before any rendering, a layout linear in the turns, and a preparation that does not hold back other
clients' requests)."""

from __future__ import annotations

import json
import random
import time

import pytest

openai = pytest.importorskip("openai", reason="the serving tests need the `serve` extra")
pytest.importorskip("fastapi", reason="the serving tests need the `serve` extra")

from transformers.generation import stopping_criteria  # noqa: E402

from peft_bitune.serving.app import build_app  # noqa: E402
from peft_bitune.serving.engine import ChatEngine  # noqa: E402
from peft_bitune.serving.server import serving_in_thread  # noqa: E402
from peft_bitune.serving.streaming import StopTextFilter, cut_at_stop  # noqa: E402
from peft_bitune.serving.validation import MAX_STOP_LENGTH, MAX_STOP_STRINGS  # noqa: E402
from serving_helpers import NAME, REQUEST_TIMEOUT_S, STORIES, assistant, load_model, post_raw, user  # noqa: E402


@pytest.fixture(scope="module")
def server(serving_adapter, serving_tokenizer, serving_template):
    engine = ChatEngine(load_model(serving_adapter), serving_tokenizer, serving_template, 64 * 2**20)
    with serving_in_thread(build_app(engine, NAME)) as url:
        yield url, engine


def client_of(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)


def request(url: str, **fields) -> tuple[int, dict]:
    body = {"model": NAME, "messages": [user(STORIES[0])], "max_tokens": 6, "temperature": 0, **fields}
    status, answer, _ = post_raw(url, json.dumps(body).encode())
    return status, answer


# ------------------------------------------------------------------------------------------------------ stop strings
def reference_stream(stop: list[str], pieces: list[str]) -> tuple[list[str], str]:
    """The straightforward filter (what the server ran before: quadratic in the stop length per piece): per piece, the
    text released, and what is left at the end."""
    pending, released = "", []
    for piece in pieces:
        pending += piece
        cut = min((i for i in (pending.find(s) for s in stop) if i >= 0), default=-1)
        if cut >= 0:
            return [*released, pending[:cut]] + [""] * (len(pieces) - len(released) - 1), ""
        held = max((n for s in stop for n in range(1, len(s)) if pending.endswith(s[:n])), default=0)
        released.append(pending[: len(pending) - held])
        pending = pending[len(pending) - held :]
    return released, pending


def test_the_stop_filter_releases_what_the_straightforward_filter_releases():
    """Random texts over two letters (many overlapping partial matches), random pieces, up to four stop strings."""
    generator = random.Random(0)
    for _ in range(3000):
        text = "".join(generator.choice("ab") for _ in range(generator.randint(0, 30)))
        stop = ["".join(generator.choice("ab") for _ in range(generator.randint(1, 6)))
                for _ in range(generator.randint(1, MAX_STOP_STRINGS))]
        cuts = sorted(generator.sample(range(len(text) + 1), min(len(text) + 1, generator.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = StopTextFilter(stop)
        released = [stream.feed(piece) for piece in pieces]
        expected, left = reference_stream(stop, pieces)
        assert (released, stream.flush()) == (expected, left), (stop, pieces)
        whole = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
        assert cut_at_stop(text, stop) == ((text[:whole], True) if whole >= 0 else (text, False)), (stop, text)


def feeding_time(stop: list[str], pieces: int = 2000) -> float:
    """Seconds per piece to feed one-character pieces that keep continuing partial matches of the stop strings (each
    piece extends the held tail, and the search tries many places in it), best of three."""
    best = float("inf")
    for _ in range(3):
        stream = StopTextFilter(stop)
        start = time.perf_counter()
        for _ in range(pieces):
            stream.feed("a")
        best = min(best, (time.perf_counter() - start) / pieces)
    return best


def test_holding_back_the_longest_stop_strings_costs_each_piece_a_bounded_time():
    """Stop strings are capped (4 of 512 characters, checked before any work), and each piece is searched with the held
    tail only: the longest stop strings the API lets through, with a partial match at many places of the held tail,
    cost each piece well under a millisecond (about 10 microseconds measured; the uncapped filter this server once ran
    took 37.6 s for 5 tokens against a 600,000-character stop)."""
    half = MAX_STOP_LENGTH // 2
    stop = ["a" * (half - 1) + "b" + "a" * (MAX_STOP_LENGTH - half - 1) + "c"] * MAX_STOP_STRINGS
    assert len(stop[0]) == MAX_STOP_LENGTH
    assert feeding_time(stop) < 1e-3


def test_stop_sequences_beyond_the_limits_are_refused_naming_the_limit(server):
    url, _ = server
    status, answer = request(url, stop=["a", "b", "c", "d", "e"])
    assert status == 400 and f"at most {MAX_STOP_STRINGS} stop sequences" in answer["error"]["message"]
    status, answer = request(url, stop=["ok", "x" * (MAX_STOP_LENGTH + 1)])
    assert status == 400 and answer["error"]["param"] == "stop[1]", answer
    assert f"at most {MAX_STOP_LENGTH} characters" in answer["error"]["message"]
    status, answer = request(url, stop="x" * 300_000)  # the request: about 300 KB under the 4 MiB limit
    assert status == 400 and answer["error"]["param"] == "stop"
    assert request(url, stop=["x" * MAX_STOP_LENGTH])[0] == 200


def test_distinct_stop_strings_leave_nothing_behind_and_still_stop_the_answer(server):
    """transformers' `StopStringCriteria` keeps a table per set of stop strings (about 4 KB per stop character, the
    last 8 for the whole process): the server's memory grew with every distinct stop string. The server's own check
    builds nothing that outlives the request, and still ends the answer where the stop string is."""
    url, _ = server
    client = client_of(url)
    cache = stopping_criteria.STOP_STRING_EMBEDDING_CACHE
    before = len(cache)
    free = client.chat.completions.create(model=NAME, messages=[user(STORIES[2])], max_tokens=6, temperature=0)
    answer = free.choices[0].message.content
    assert len(answer) > 3, "the check needs a longer answer"
    for i in range(10):
        stop = [answer[2:4], "x" * (MAX_STOP_LENGTH - i)]  # ten distinct sets of stop strings
        cut = client.chat.completions.create(model=NAME, messages=[user(STORIES[2])], max_tokens=6, temperature=0,
                                             stop=stop)
        assert cut.choices[0].message.content == answer[: answer.find(answer[2:4])]
        assert cut.choices[0].finish_reason == "stop"
        assert cut.usage.completion_tokens <= free.usage.completion_tokens
    assert len(cache) == before


# ------------------------------------------------------------------------------------------------------- many turns
def many_turns(pairs: int) -> list[dict]:
    """`pairs` user/assistant turns and a last question: short, distinct messages."""
    messages = []
    for i in range(pairs):
        messages += [user(f"Ask: is {i} even?"), assistant(f"Answer: {'yes' if i % 2 else 'no'}")]
    return [*messages, user("Ask: and now?")]


def best_time(function, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        best = min(best, time.perf_counter() - start)
    return best


def test_thousands_of_turns_are_refused_before_any_rendering_as_fast_as_a_small_request(server, monkeypatch):
    """2,000 user/assistant pairs cannot fit in the model's positions, which a bound on the messages shows without
    rendering them: refused at once (the server rendered the conversation up to every answer first, 46.9 s for as
    many pairs). The time is bounded as a ratio to a small request's, answered in the same run."""
    url, engine = server
    rendered = []
    monkeypatch.setattr(engine.prompts, "render", lambda *args, **kwargs: rendered.append(args) or "")
    body = json.dumps({"model": NAME, "messages": many_turns(2000), "max_tokens": 1, "temperature": 0}).encode()
    long_time = best_time(lambda: post_raw(url, body))
    status, answer, _ = post_raw(url, body)
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded", answer
    assert "take at least" in answer["error"]["message"] and rendered == []
    monkeypatch.undo()
    small_time = best_time(lambda: request(url, max_tokens=1))
    assert long_time < 10 * small_time, (long_time, small_time)


def test_one_requests_preparation_does_not_hold_back_another(server, monkeypatch):
    """A request whose preparation does not end (held here on purpose) leaves the others' preparations running: a
    small request is answered meanwhile (one preparation thread served every client in turn)."""
    import threading

    url, engine = server
    release, started = threading.Event(), threading.Event()
    build = engine.prompts.build

    def held_build(messages):
        if messages[0]["content"] == "hold":
            started.set()
            release.wait(REQUEST_TIMEOUT_S)
        return build(messages)

    monkeypatch.setattr(engine.prompts, "build", held_build)
    held = threading.Thread(target=request, args=(url,), kwargs={"messages": [user("hold")]})
    held.start()
    try:
        assert started.wait(REQUEST_TIMEOUT_S)
        answered = []
        small = threading.Thread(target=lambda: answered.append(request(url, max_tokens=1)[0]))
        small.start()
        small.join(60)
        assert answered == [200] and not release.is_set() and held.is_alive()
    finally:
        release.set()
        held.join(REQUEST_TIMEOUT_S)
