"""How `bitune-serve` guards itself (`ServerSettings`): API keys, allowed origins, the API docs page, the largest
request body. Plain data, so that the command can build it without the `serve` extra."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20


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
        if any(not key for key in self.api_keys):
            raise ValueError("An API key cannot be empty.")
        if self.max_request_bytes < 1:
            raise ValueError(f"`max_request_bytes` must be at least 1, got {self.max_request_bytes}.")
