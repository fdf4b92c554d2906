"""Checks of a chat completion request body, each answered with OpenAI's error object and a 4xx status before any work.

FastAPI reads the body as JSON and validates it as `ChatCompletionRequest`, a pydantic model with OpenAI's field names
and types for the fields this server honours; `refusal` turns pydantic's errors into OpenAI's error object (as vLLM's
server does), naming the field by its request path and telling what it must be. Strictly: an integer field takes a
JSON integer only, a number field a finite number (NaN and Infinity, which Python's JSON parser reads, are refused),
and text must be valid Unicode (no lone surrogate such as "\\ud800", which no tokenizer can encode). Nothing is
silently ignored: unknown fields are refused by name.

A `TypeAdapter` over OpenAI's own request type (`openai.types.chat`'s `CompletionCreateParams`) was considered and
does not fit: it takes some thirty fields this server does not honour (tools, logprobs, images and audio in messages,
...) and cannot be told to refuse unknown ones, its keys change from one `openai` release to the next (newer text
parts take a `prompt_cache_breakpoint`), and its `Iterable` fields are validated lazily, after the checks.
"""

from __future__ import annotations

import functools
import reprlib
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal, get_args

from fastapi.responses import JSONResponse
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    with_config,
)
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict

MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_LENGTH = 512  # characters per stop sequence (OpenAI states no limit; ours bounds what a stream holds back)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts
# Strict (see the module docstring; a boolean field takes a JSON boolean only, not 1 or "true"), at every level.
_STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class OpenAIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = "invalid_request_error" if status < 500 else "server_error"

    def body(self) -> dict:
        """The error object; text that is not valid Unicode (a refused field's name or value) written escaped."""
        message, param = (None if text is None else text.encode("utf-8", "backslashreplace").decode()
                          for text in (self.message, self.param))
        return {"error": {"message": message, "type": self.type, "param": param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def _valid_unicode(text: str) -> str:
    """Refuse a string holding a lone surrogate: pydantic's `str` takes one (JSON's \\u escapes can write it), and
    every tokenizer refuses it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError(
            "lone_surrogate", "it is not valid Unicode text: it holds a lone surrogate (e.g. the escape \\ud800 "
            "without its pair); send text as UTF-8, with surrogate escapes only in pairs",
        ) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]


def _string_or_list(string: Any, items: Any) -> Any:
    """OpenAI's `str | list[...]` fields, discriminated by the value's form, so that only its form's errors show."""
    form = Discriminator(lambda value: "string" if isinstance(value, str) else "list")
    return Annotated[Annotated[string, Tag("string")] | Annotated[items, Tag("list")], form]


Role = Literal["system", "developer", "user", "assistant"]
ROLES = get_args(Role)


@with_config(_STRICT)
class TextPart(TypedDict):
    """A text part of a message's content, as OpenAI's `ChatCompletionContentPartTextParam` (this model reads text
    only: images, audio and files are refused)."""

    type: Literal["text"]
    text: Text


Content = _string_or_list(Text, list[TextPart])


@with_config(_STRICT)
class ChatMessage(TypedDict):
    """A message: `role` and `content` only (OpenAI's `name`, tool calls and refusals are not honoured)."""

    role: Role
    content: Content


StopString = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
Stop = _string_or_list(StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)])


class ChatCompletionRequest(BaseModel):
    """A chat completion request: the fields of OpenAI's `CompletionCreateParams` this server honours, with OpenAI's
    names and types, and bounds where the server needs them. Fields are checked in this order (the first wrong one is
    told), after unknown fields; `model` is checked against `served_model` (see `serving`)."""

    model_config = _STRICT
    served_model: ClassVar[str | None] = None  # the model of this server; any name when None

    model: Text
    n: Annotated[int, Field(ge=1, le=1)] | None = None
    stream: bool | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    stop: Stop | None = None
    user: Text | None = None
    prompt_cache_key: Text | None = None

    @classmethod
    @functools.cache
    def serving(cls, served_model: str) -> type[ChatCompletionRequest]:
        """The request of a server of `served_model`, which refuses other models' names (404). A class of its own, not
        a validation context: FastAPI validates a body against a type, without context."""
        return type(cls.__name__, (cls,), {"served_model": served_model, "__module__": cls.__module__})

    @field_validator("model")
    @classmethod
    def _served(cls, model: str) -> str:
        served = cls.served_model
        if served is not None and model != served:
            raise PydanticCustomError(
                "model_not_found", "The model `{model}` does not exist; this server serves `{served}`.",
                {"model": model, "served": served},
            )
        return model

    @property
    def answer_tokens(self) -> int | None:
        """The most tokens to answer with: `max_completion_tokens`, OpenAI's newer name, wins (as in transformers
        serve)."""
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    @property
    def stop_strings(self) -> list[str]:
        return [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def text_messages(self) -> list[dict]:
        """The messages as a chat template takes them: text parts joined into one string with spaces (as
        `transformers serve` does for text-only models)."""
        return [{"role": message["role"], "content": message["content"] if isinstance(message["content"], str)
                 else " ".join(part["text"] for part in message["content"])} for message in self.messages]


SUPPORTED_FIELDS = frozenset(ChatCompletionRequest.model_fields)
# What each field must be, told with every refusal of it (or of anything inside it), keyed by its path.
_EXPECTED = {
    ("model",): "the name of the model this server serves (see GET /v1/models)",
    ("n",): "the integer 1 (one answer per request)",
    ("stream",): "true or false (a JSON boolean)",
    ("messages",): "a non-empty list of messages, each an object with `role` and `content` only",
    ("messages", "role"): f"one of {list(ROLES)}",
    ("messages", "content"): 'a string or a list of text parts {"type": "text", "text": "..."} (this model reads text '
                             "only)",
    ("max_completion_tokens",): "an integer of at least 1",
    ("max_tokens",): "an integer of at least 1",
    ("temperature",): "a number from 0 to 2",
    ("top_p",): "a number above 0 and at most 1",
    ("seed",): f"an integer from {SEED_RANGE[0]} to {SEED_RANGE[1]} (what torch can seed)",
    ("stop",): f"a non-empty string, or a list of at most {MAX_STOP_STRINGS} stop sequences (as OpenAI's API), each "
               f"at most {MAX_STOP_LENGTH} characters long",
    ("user",): "a string",
    ("prompt_cache_key",): "a string",
}
_UNION_FIELDS = {"content", "stop"}  # their errors' locations hold the form (`_string_or_list`), not in the request
_SHOWN = reprlib.Repr()  # a refused value, shown short however large it is
_SHOWN.maxstring = _SHOWN.maxother = 80
_SHOWN.maxlist = _SHOWN.maxdict = 4
_SHOWN.maxlevel = 2


def check_request(body: Any, served_model: str) -> ChatCompletionRequest:
    """The body as a server of `served_model` reads it (what FastAPI does with a request body, for Python callers);
    raises `OpenAIError` as the server answers."""
    try:
        return ChatCompletionRequest.serving(served_model).model_validate(body)
    except ValidationError as error:
        raise refusal(error.errors(include_url=False)) from None


def refusal(errors: Sequence[Any]) -> OpenAIError:
    """OpenAI's error object for pydantic's errors (or FastAPI's, whose locations start at "body"): it holds one error
    where pydantic lists each, so the unknown fields are told (all at once), else the first error, with its location
    as a request path and what the field must be."""
    errors = [{**error, "loc": tuple(error["loc"])[1:] if tuple(error["loc"])[:1] == ("body",) else error["loc"]}
              for error in errors]
    unknown = sorted(str(error["loc"][0]) for error in errors if error["type"] == "extra_forbidden"
                     and len(error["loc"]) == 1)
    if unknown:
        return OpenAIError(
            400, f"Unsupported request fields {unknown}; bitune-serve supports {sorted(SUPPORTED_FIELDS)}.", unknown[0]
        )
    error = errors[0]
    if error["type"] == "json_invalid":  # FastAPI's: the body is not JSON
        return OpenAIError(400, f"The request body is not valid JSON: {error.get('ctx', {}).get('error', '')}.")
    if not error["loc"]:
        return OpenAIError(400, f"The request body must be a chat completion request (a JSON object): {error['msg']}.")
    if error["type"] == "model_not_found":
        return OpenAIError(404, error["msg"], "model", "model_not_found")
    param, subject, expected = _located(error["loc"])
    if error["type"] == "missing":
        what = f"Missing `{param}`"
    elif error["type"] == "extra_forbidden":
        what = f"Unsupported field `{param}`"
    else:
        what = f"Invalid `{param}`: {error['msg']}, got {_SHOWN.repr(error['input'])}"
    return OpenAIError(400, f"{what}. `{subject}` must be {expected}.", param)


def _located(loc: tuple) -> tuple[str, str, str]:
    """(the request path of an error's location, e.g. `messages[0].content[1].text`; the path of the nearest field
    that holds it whose expected value `_EXPECTED` tells; that expected value)."""
    param, path, subject, expected = "", (), "body", "a chat completion request object"
    for i, item in enumerate(loc):
        if isinstance(item, int):
            param += f"[{item}]"
        elif i and loc[i - 1] in _UNION_FIELDS and item in ("string", "list"):
            continue
        else:
            param = f"{param}.{item}" if param else str(item)
            path += (item,)
            if path in _EXPECTED:
                subject, expected = param, _EXPECTED[path]
    return param, subject, expected
