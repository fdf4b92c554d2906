"""Checks of a chat completion request body, each answered with OpenAI's error object and a 4xx status before any work.

A body is refused when it is not strict JSON (NaN and Infinity are not JSON, though Python's parser reads them), when
it holds an integer of more digits than Python converts (4,300 by default; no field takes a number near that), when
it holds text that is not valid Unicode (a lone surrogate such as "\\ud800", which no tokenizer can encode), and when a
field has a value OpenAI's API would refuse. Nothing is silently ignored: unknown fields are refused by name.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

from fastapi.responses import JSONResponse

# Request fields this server honours; anything else is refused rather than silently ignored.
SUPPORTED_FIELDS = {
    "model", "messages", "stream", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "n",
    "user", "prompt_cache_key",
}
ROLES = {"system", "developer", "user", "assistant"}
MAX_STOP_STRINGS = 4  # as OpenAI's API
MAX_STOP_LENGTH = 512  # characters per stop sequence (OpenAI states no limit; ours bounds what a stream holds back)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed accepts


class OpenAIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = "invalid_request_error" if status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def parse_body(raw: bytes) -> dict:
    """The request body as a JSON object of valid Unicode text; raises `OpenAIError` (400) otherwise."""
    try:
        body = json.loads(raw, parse_constant=_refuse_constant, parse_int=_parse_int)
        if not isinstance(body, dict):
            raise OpenAIError(400, f"The request body must be a JSON object, got {type(body).__name__}.")
        _check_unicode(body, "")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise OpenAIError(400, f"The request body is not valid JSON: {error}.") from error
    except RecursionError:
        raise OpenAIError(400, "The request body is nested too deeply to be a chat completion request.") from None
    return body


def _parse_int(text: str) -> int:
    """A JSON integer, refused (400) where it has more digits than Python converts (`sys.get_int_max_str_digits()`):
    `int` raises a `ValueError` that would otherwise be a 500."""
    try:
        return int(text)
    except ValueError:
        raise OpenAIError(
            400, f"The request body holds an integer of {len(text.lstrip('-'))} digits, more than this server reads "
            f"({sys.get_int_max_str_digits()}); no field takes a number that large.",
        ) from None


def _refuse_constant(name: str) -> Any:
    raise json.JSONDecodeError(f"{name} is not a JSON value (numbers must be finite)", name, 0)


def _check_unicode(value: Any, where: str) -> None:
    """Refuse strings (keys and values) that cannot be encoded as UTF-8: JSON's \\u escapes can write a lone
    surrogate, which Python keeps in a `str` and every tokenizer refuses."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise OpenAIError(
                400, f"`{where or 'body'}` is not valid Unicode text: it holds a lone surrogate (e.g. the escape "
                "\\ud800 without its pair). Send text as UTF-8, with surrogate escapes only in pairs.", where or None,
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, where)
            _check_unicode(item, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_unicode(item, f"{where}[{i}]")


def check_fields(body: dict) -> None:
    unsupported = sorted(set(body) - SUPPORTED_FIELDS)
    if unsupported:
        raise OpenAIError(
            400, f"Unsupported request fields {unsupported}; bitune-serve supports {sorted(SUPPORTED_FIELDS)}.",
            param=unsupported[0],
        )


def check_n_and_stream(body: dict) -> None:
    """`n` and `stream` with OpenAI's types, strictly: `n` a JSON integer (1 here; not 1.0 or true) and `stream` a JSON
    boolean (not 1 or "true"). Python compares 1.0 == 1 and 1 == True, so the types are checked, not only the
    values."""
    n, stream = body.get("n"), body.get("stream")
    if n is not None and (type(n) is not int or n != 1):
        raise OpenAIError(400, f"`n` must be the integer 1 (one answer per request), got {n!r}.", "n")
    if stream is not None and type(stream) is not bool:
        raise OpenAIError(400, f"`stream` must be true or false (a JSON boolean), got {stream!r}.", "stream")


def check_messages(messages: Any) -> list[dict]:
    """The messages, checked: text content only (a string or a list of text parts), known roles."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "`messages` must be a non-empty list of {role, content} objects.", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or set(message) - {"role", "content"} or "role" not in message:
            raise OpenAIError(
                400, f"`{where}` must be an object with `role` and `content` only, got {message!r:.200}.", where
            )
        if message["role"] not in ROLES:
            raise OpenAIError(400, f"`{where}.role` must be one of {sorted(ROLES)}, got {message['role']!r}.", where)
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list) or not all(
            isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            for part in parts
        ):
            raise OpenAIError(
                400, f"`{where}.content` must be a string or a list of text parts (this model reads text only).", where
            )
    return messages


def text_messages(messages: list[dict]) -> list[dict]:
    """The messages as a chat template takes them: text parts joined into one string with spaces (as `transformers
    serve` does for text-only models)."""
    texts = [m["content"] if isinstance(m.get("content"), str) else " ".join(p["text"] for p in m.get("content") or [])
             for m in messages]
    return [{"role": message["role"], "content": text} for message, text in zip(messages, texts)]


def optional_number(body: dict, name: str, kind: type, low: float | None = None, high: float | None = None) -> Any:
    """`body[name]` as an int or a finite float within [low, high], or None if absent."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise OpenAIError(400, f"`{name}` must be a{'n integer' if kind is int else ' number'}, got {value!r}.", name)
    if not math.isfinite(value):
        raise OpenAIError(400, f"`{name}` must be a finite number, got {value!r}.", name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise OpenAIError(400, f"`{name}` must be {bounds}, got {value!r}.", name)
    return kind(value)


def optional_string(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise OpenAIError(400, f"`{name}` must be a string, got {value!r:.100}.", name)
    return value


def check_stop(stop: Any) -> list[str]:
    """The stop strings: at most `MAX_STOP_STRINGS` (as OpenAI's API), each non-empty and at most `MAX_STOP_LENGTH`
    characters, so that what a request makes the server hold (its stop strings, the text a stream holds back) is
    bounded."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)):
        raise OpenAIError(
            400,
            f"`stop` must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them, got {stop!r:.200}.",
            "stop",
        )
    if len(stops) > MAX_STOP_STRINGS:
        raise OpenAIError(
            400, f"`stop` may hold at most {MAX_STOP_STRINGS} stop sequences (as OpenAI's API), got {len(stops)}.",
            "stop",
        )
    for i, s in enumerate(stops):
        if len(s) > MAX_STOP_LENGTH:
            where = "stop" if isinstance(stop, str) else f"stop[{i}]"
            raise OpenAIError(
                400, f"Each `stop` sequence may be at most {MAX_STOP_LENGTH} characters long; `{where}` has {len(s)}.",
                where,
            )
    return stops
