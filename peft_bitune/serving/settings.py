"""How `bitune-serve` guards itself (`ServerSettings`: API keys, allowed origins, the API docs page, the largest
request body) and how it batches (`BatchLimits`). Plain data, so that the command can check and build them without the
`serve` extra."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


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


@dataclass(frozen=True)
class ServerSettings:
    """
    How the server guards itself.

    Args:
        api_keys (`tuple[str, ...]`): every `/v1` call needs `Authorization: Bearer <one of them>`; none: open (for a
            server that only this machine can reach). Each key also keeps its own conversations.
        allowed_origins (`tuple[str, ...]`): web origins allowed to call the server from a browser (CORS); none by
            default, so browsers refuse cross-site calls that read the answers.
        docs (`bool`): serve the interactive API documentation at `/docs` (and the schema at `/openapi.json`).
        max_request_bytes (`int`): the largest request body; a larger one is refused before it is read on.
    """

    api_keys: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    docs: bool = False
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        for key in self.api_keys:
            if problem := api_key_problem(key):
                raise ValueError(problem)
        if self.max_request_bytes < 1:
            raise ValueError(f"`max_request_bytes` must be at least 1, got {self.max_request_bytes}.")


DEFAULT_MAX_BATCH_SIZE = 8
DEFAULT_MAX_BATCH_TOKENS = 65536


@dataclass(frozen=True)
class BatchLimits:
    """
    How many waiting requests the model worker answers together.

    Args:
        max_batch_size (`int`): the most requests in one batch; 1 answers them one at a time.
        max_batch_tokens (`int`): the most tokens a batch's padded cache may grow to: its rows times (its longest
            prompt plus the most tokens any of its answers may take). It bounds the memory of a batch. A request larger
            than this on its own is answered alone, never refused for its size.
    """

    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be an integer of at least 1, got {value!r}.")
