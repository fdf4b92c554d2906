"""How `bitune-serve` guards itself (`ServerSettings`: API keys, allowed origins, the API docs page, the largest
request body) and how it batches (`BatchLimits`). Plain data, checked when made, so that the command can parse them
(transformers' `HfArgumentParser` makes their flags from the fields) and check them without the `serve` extra."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..utils.command_line_numbers import number_problem

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_MAX_BATCH_TOKENS = 65536


def api_key_problem(key: str) -> str | None:
    """Why `key` cannot be an API key, or None. A key must be printable ASCII without surrounding spaces: HTTP clients
    send header values as bytes (curl as UTF-8, others as Latin-1), so a key with other characters matches for some
    clients and not others, and spaces around it are stripped from the header."""
    if not key:
        return "An API key cannot be empty."
    if not (key.isascii() and key.isprintable()):
        bad = next(c for c in key if not (c.isascii() and c.isprintable()))
        return (f"An API key must be printable ASCII (letters, digits, punctuation): {bad!r} is not, and clients send "
                "other characters in different byte encodings (curl as UTF-8, others as Latin-1), so the key would "
                "match for some clients only. Choose a key of printable ASCII characters.")
    if key != key.strip():
        return "An API key cannot start or end with a space (HTTP strips them from the header)."
    return None


def check_count(name: str, value: Any) -> None:
    """Refuse a count (bytes, requests, tokens) that is not a whole number from 1 up that fits in 64 bits."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"`{name}` must be a whole number, got {value!r}.")
    if problem := number_problem(value):
        raise ValueError(f"`{name}` {problem}.")
    if value < 1:
        raise ValueError(f"`{name}` must be at least 1, got {value}.")


@dataclass(frozen=True)
class ServerSettings:
    """How the server guards itself (each field's help says how). No API keys: open, for a server only this machine
    can reach; no origins: browsers refuse cross-site calls that read the answers."""

    # Lists for the parser (a repeated `--api-key` appends a list); kept as tuples.
    api_keys: list[str] = field(default_factory=list, metadata={
        "aliases": ["--api-key"], "action": "append", "metavar": "KEY",
        "help": "Require `Authorization: Bearer KEY` on every /v1 call; give it again for more keys (each keeps its "
        "own conversations). Default: the BITUNE_SERVE_API_KEY environment variable."})
    allowed_origins: list[str] = field(default_factory=list, metadata={
        "metavar": "ORIGIN", "help": "Web origins (e.g. https://app.example.com) allowed to call the server from a "
        "browser (CORS). Default: none."})
    docs: bool = field(default=False, metadata={"help": "Serve the interactive API docs at /docs."})
    max_request_bytes: int = field(default=DEFAULT_MAX_REQUEST_BYTES, metadata={
        "help": "The largest request body accepted (default: 4 MiB); larger ones get 413 unread."})

    def __post_init__(self) -> None:
        # The parser's appended groups (`--api-key a b --api-key c`) flattened; a key given alone is one key.
        keys = [key for group in self.api_keys for key in ([group] if isinstance(group, str) else group)]
        object.__setattr__(self, "api_keys", tuple(keys))
        object.__setattr__(self, "allowed_origins", tuple(self.allowed_origins))
        for key in self.api_keys:
            if problem := api_key_problem(key):
                raise ValueError(f"`api_keys`: {problem}")
        check_count("max_request_bytes", self.max_request_bytes)


@dataclass(frozen=True)
class BatchLimits:
    """How many waiting requests the model worker answers together. `max_batch_tokens` bounds the memory of a batch;
    a request larger than it on its own is answered alone, never refused for its size."""

    max_batch_size: int = field(default=DEFAULT_MAX_BATCH_SIZE, metadata={
        "help": f"The most requests answered together: requests that arrive while the model is busy are answered in "
        f"one batch next (default: {DEFAULT_MAX_BATCH_SIZE}; 1: one at a time)."})
    max_batch_tokens: int = field(default=DEFAULT_MAX_BATCH_TOKENS, metadata={
        "help": "The most tokens a batch's padded cache may grow to: its rows times (its longest prompt plus the most "
        f"tokens any of its answers may take); a larger request is answered alone (default: "
        f"{DEFAULT_MAX_BATCH_TOKENS})."})

    def __post_init__(self) -> None:
        check_count("max_batch_size", self.max_batch_size)
        check_count("max_batch_tokens", self.max_batch_tokens)
