"""A chat completion request's fields are checked by a pydantic model with OpenAI's names and types
(`peft_bitune/serving/validation.py`): each wrong field is refused by its path in `param`, with what it must be in the
message, in the order the server tells them. Needs no model: the HTTP side of these refusals is in
test_serving_safety.py."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai", reason="the serving tests need the `serve` extra")
pytest.importorskip("fastapi", reason="the serving tests need the `serve` extra")

from openai.types.chat.completion_create_params import CompletionCreateParamsStreaming  # noqa: E402

from peft_bitune.serving.validation import (  # noqa: E402
    ChatCompletionRequest,
    OpenAIError,
    check_request,
)

NAME = "served-model"
GOOD = {"model": NAME, "messages": [{"role": "user", "content": "Ask: hi?"}]}


def refused(body: dict) -> OpenAIError:
    with pytest.raises(OpenAIError) as error:
        check_request(body, NAME)
    return error.value


def with_content(*content) -> dict:
    return {"messages": [{"role": "user", "content": part} for part in content]}


@pytest.mark.parametrize(("change", "param", "fix"), [
    ({"model": 7}, "model", "the name of the model this server serves"),
    ({"n": 2}, "n", "the integer 1"),
    ({"n": 1.0}, "n", "the integer 1"),
    ({"n": True}, "n", "the integer 1"),
    ({"stream": 1}, "stream", "true or false"),
    ({"stream": "true"}, "stream", "true or false"),
    ({"messages": []}, "messages", "a non-empty list of messages"),
    ({"messages": "Ask: hi?"}, "messages", "a non-empty list of messages"),
    ({"messages": ["Ask: hi?"]}, "messages[0]", "a non-empty list of messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "'developer'"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "'developer'"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "a list of text parts"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "a list of text parts"),
    ({"messages": [{"role": "user", "content": "x", "name": "bo"}]}, "messages[0].name", "`role` and `content` only"),
    (with_content("x", [{"type": "image_url", "image_url": {"url": "x"}}]), "messages[1].content[0].type",
     "text only"),
    (with_content([{"type": "text", "text": 5}]), "messages[0].content[0].text", "text only"),
    (with_content([{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]),
     "messages[0].content[0].cache_control", "text only"),
    ({"max_tokens": 0}, "max_tokens", "an integer of at least 1"),
    ({"max_completion_tokens": 2.0}, "max_completion_tokens", "an integer of at least 1"),
    ({"temperature": 3}, "temperature", "a number from 0 to 2"),
    ({"temperature": True}, "temperature", "a number from 0 to 2"),
    ({"temperature": float("inf")}, "temperature", "a number from 0 to 2"),  # JSON's 1e999 reads as inf
    ({"top_p": 0}, "top_p", "above 0"),
    ({"top_p": 1.5}, "top_p", "at most 1"),
    ({"seed": 2**64}, "seed", "what torch can seed"),
    ({"seed": -(2**63) - 1}, "seed", "what torch can seed"),
    ({"seed": 1.5}, "seed", "what torch can seed"),
    ({"stop": ""}, "stop", "a non-empty string"),
    ({"stop": 7}, "stop", "a non-empty string"),
    ({"stop": ["a", 7]}, "stop[1]", "at most 4 stop sequences"),
    ({"user": 7}, "user", "a string"),
    ({"prompt_cache_key": ["a"]}, "prompt_cache_key", "a string"),
])
def test_a_wrong_field_is_refused_by_its_path_with_what_it_must_be(change, param, fix):
    error = refused({**GOOD, **change})
    assert (error.status, error.type, error.param, error.code) == (400, "invalid_request_error", param, None)
    assert f"`{param}`" in error.message and fix in error.message, error.message


def test_the_model_is_required_and_must_be_the_served_one():
    """A missing model is a 400 (OpenAI's API answers so too: `model` is required), no longer a 404 for a model named
    `None`; another model's name is a 404 that names the served one."""
    missing = refused({"messages": GOOD["messages"]})
    assert (missing.status, missing.param) == (400, "model") and "Missing `model`" in missing.message
    other = refused({**GOOD, "model": "gpt-4o"})
    assert (other.status, other.param, other.code) == (404, "model", "model_not_found")
    assert "`gpt-4o`" in other.message and f"serves `{NAME}`" in other.message


def test_unknown_fields_come_first_and_all_by_name_then_the_model_then_fields_in_order():
    body = {**GOOD, "model": "gpt-4o", "temperature": 3, "tools": [], "logprobs": True}
    unknown = refused(body)
    assert (unknown.status, unknown.param) == (400, "logprobs") and "['logprobs', 'tools']" in unknown.message
    assert "'prompt_cache_key'" in unknown.message  # the supported fields are listed
    assert refused({**body, "tools": None, "logprobs": None}).param == "logprobs"  # null is no way to send nothing
    assert refused({**GOOD, "model": "gpt-4o", "temperature": 3}).status == 404
    assert refused({**GOOD, "seed": 1.5, "temperature": 3, "n": 2}).param == "n"
    assert refused({**GOOD, "seed": 1.5, "temperature": 3}).param == "temperature"


def test_more_stop_sequences_than_openai_allows_is_told_before_their_lengths():
    error = refused({**GOOD, "stop": ["a", "x" * 600, "b", "c", "d"]})
    assert error.param == "stop" and "List should have at most 4 items" in error.message


def test_a_refused_value_is_shown_short_however_large():
    error = refused({**GOOD, "stop": "x" * 300_000})
    assert error.param == "stop" and "at most 512 characters" in error.message and len(error.message) < 400


def test_an_accepted_request_reads_as_openai_defines_it():
    request = check_request({
        **GOOD, "n": 1, "stream": False, "temperature": 1, "top_p": 1, "stop": "\n", "seed": 2**64 - 1, "user": "u",
        "max_tokens": 9, "max_completion_tokens": 3, "prompt_cache_key": "k",
        "messages": [{"role": "developer", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Ask:"}, {"type": "text", "text": "hi?"}]},
                     {"role": "assistant", "content": []}],
    }, NAME)
    assert request.text_messages() == [{"role": "developer", "content": "Be brief."},
                                       {"role": "user", "content": "Ask: hi?"}, {"role": "assistant", "content": ""}]
    assert request.answer_tokens == 3  # max_completion_tokens, OpenAI's newer name, wins
    assert request.stop_strings == ["\n"] and type(request.temperature) is float and request.seed == 2**64 - 1
    assert (request.user, request.prompt_cache_key) == ("u", "k")
    assert check_request({**GOOD, "stop": ["a", "b"], "max_tokens": 9}, NAME).stop_strings == ["a", "b"]
    assert check_request({**GOOD, "max_tokens": 9}, NAME).answer_tokens == 9
    # A field sent as null is a field not sent, as in OpenAI's API.
    optional = set(ChatCompletionRequest.model_fields) - {"model", "messages"}
    nulls = check_request({**GOOD, **dict.fromkeys(optional)}, NAME)
    assert nulls.answer_tokens is None and nulls.stop_strings == [] and nulls.temperature is None


def test_the_request_fields_are_openais():
    """Every field the server honours is one of OpenAI's chat completion request fields, under the same name."""
    assert set(ChatCompletionRequest.model_fields) <= set(CompletionCreateParamsStreaming.__annotations__)


def test_non_finite_numbers_and_lone_surrogates_are_refused_by_their_field():
    """NaN and Infinity (which Python's JSON parser reads) are no numbers here, and a lone surrogate (which pydantic's
    `str` takes) is no text: each is refused by its field's path."""
    for change, param in (({"top_p": float("nan")}, "top_p"), ({"temperature": float("-inf")}, "temperature")):
        error = refused({**GOOD, **change})
        assert (error.status, error.param) == (400, param) and "finite number" in error.message, error.message
    surrogate = refused(with_content([{"type": "text", "text": "a\ud800"}]) | {"model": NAME})
    assert surrogate.param == "messages[0].content[0].text" and "lone surrogate" in surrogate.message
    assert refused({**GOOD, "stop": ["ok", "\udc00"]}).param == "stop[1]"
    for body in ({**GOOD, "x\udc00": 1}, {**GOOD, "messages": [{"role": "user", "content": "x", "n\udc00": 1}]}):
        error = refused(body)  # a refused key that is no text: the answer is still UTF-8
        assert error.status == 400 and json.dumps(error.body(), ensure_ascii=False).encode("utf-8")
