"""The OpenAI-compatible HTTP API of `bitune-serve` (FastAPI).

Requests are checked here and answered with OpenAI's own response types (the `openai` package's `ChatCompletion`, and
`ChatCompletionChunk` as server-sent events when streaming) or OpenAI's JSON error objects. The model work runs on the
engine's worker thread (`engine.py`), so that the event loop stays free for other clients while an answer is
generated.
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.completion_usage import CompletionUsage, PromptTokensDetails
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import ChatEngine, ChatRequest, ChatResult
from .streaming import StopTextFilter, TextStream

# Request fields this server honours; anything else is refused rather than silently ignored.
SUPPORTED_FIELDS = {
    "model", "messages", "stream", "max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "n",
    "user",
}
ROLES = {"system", "developer", "user", "assistant"}
MAX_STOP_STRINGS = 4  # as OpenAI's API


class OpenAIError(Exception):
    """An error answered as OpenAI does: `{"error": {"message", "type", "param", "code"}}` with an HTTP status."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_WORK_DONE = object()  # queued after the worker finished a streaming request, whatever happened


class ChatCompletions:
    """`POST /v1/chat/completions` over a `ChatEngine`: validation, then one job on the model worker."""

    def __init__(self, engine: ChatEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.cancelled_streams = 0  # streams whose client left before the answer was complete

    async def handle_request(self, body: dict, request_id: str) -> JSONResponse | StreamingResponse:
        request = self.chat_request(body)
        if body.get("stream"):
            return self._stream(request, request_id)
        try:
            result = await self.engine.worker.async_submit(self.engine.run, request)
        except ValueError as error:  # a check of `generate` (e.g. positions): the request's fault
            raise OpenAIError(400, str(error)) from error
        completion = ChatCompletion(
            id=request_id,
            created=int(time.time()),
            object="chat.completion",
            model=self.model_name,
            choices=[Choice(index=0, finish_reason=result.finish_reason,
                            message=ChatCompletionMessage(role="assistant", content=result.content))],
            usage=_usage(result),
        )
        return JSONResponse(completion.model_dump(exclude_none=True))

    def chat_request(self, body: dict) -> ChatRequest:
        """Check a request body and render its conversation; raises `OpenAIError` for anything wrong."""
        unsupported = sorted(set(body) - SUPPORTED_FIELDS)
        if unsupported:
            raise OpenAIError(
                400, f"Unsupported request fields {unsupported}; bitune-serve supports {sorted(SUPPORTED_FIELDS)}.",
                param=unsupported[0],
            )
        model = body.get("model")
        if model != self.model_name:
            raise OpenAIError(
                404, f"The model `{model}` does not exist; this server serves `{self.model_name}`.", "model",
                "model_not_found",
            )
        if body.get("n") not in (None, 1) or isinstance(body.get("n"), bool):
            raise OpenAIError(400, f"`n` must be 1 (one answer per request), got {body['n']!r}.", "n")
        if body.get("stream") not in (None, True, False):
            raise OpenAIError(400, f"`stream` must be true or false, got {body['stream']!r}.", "stream")
        messages = _check_messages(body.get("messages"))
        max_completion_tokens = _optional_number(body, "max_completion_tokens", int, 1)
        max_tokens = _optional_number(body, "max_tokens", int, 1)
        if max_completion_tokens is not None:
            max_tokens = max_completion_tokens  # OpenAI's newer name wins, as in transformers serve
        temperature = _optional_number(body, "temperature", float, 0.0, 2.0)
        top_p = _optional_number(body, "top_p", float, 0.0, 1.0)
        if top_p == 0.0:
            raise OpenAIError(400, "`top_p` must be above 0.", "top_p")
        seed = _optional_number(body, "seed", int)
        stop = _check_stop(body.get("stop"))
        try:
            prompt_text = self.engine.render(_text_messages(messages))
        except TemplateError as error:
            raise OpenAIError(400, f"The chat template refused the messages: {error}", "messages") from error
        prompt_ids = self.engine.tokenize(prompt_text)
        if not self.engine.room_for(len(prompt_ids), max_tokens):
            raise OpenAIError(
                400,
                f"This model's maximum context length is {self.engine.max_positions} tokens; the messages take "
                f"{len(prompt_ids)} tokens and {max_tokens or 1} more are asked for. Shorten the conversation or "
                "lower `max_tokens` (nothing is truncated silently).",
                "messages", "context_length_exceeded",
            )
        # Seeded on the worker, right before this request runs: seeding here would reseed whatever runs meanwhile.
        return ChatRequest(prompt_text, prompt_ids, self._generation_config(temperature, top_p, stop), max_tokens,
                           stop, seed)

    def _generation_config(self, temperature: float | None, top_p: float | None, stop: list[str]) -> Any:
        """The model's generation config with the request's settings: greedy at temperature 0, sampling at any
        other temperature or `top_p` (as OpenAI does), the model's own choice when neither is given."""
        generation_config = copy.deepcopy(self.engine.model.generation_config)
        if stop:
            generation_config.stop_strings = stop
        if temperature == 0.0:
            generation_config.do_sample = False
            generation_config.temperature = generation_config.top_p = None  # greedy: no sampling settings to warn of
        elif temperature is not None or top_p is not None:
            generation_config.do_sample = True
            if temperature is not None:
                generation_config.temperature = temperature
            if top_p is not None:
                generation_config.top_p = top_p
        if generation_config.pad_token_id is None:
            generation_config.pad_token_id = self.engine.tokenizer.pad_token_id or generation_config.eos_token_id
        return generation_config

    def _stream(self, request: ChatRequest, request_id: str) -> StreamingResponse:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        stream = TextStream(self.engine.tokenizer, lambda text: loop.call_soon_threadsafe(queue.put_nowait, text))

        def work() -> ChatResult | None:
            try:
                return self.engine.run(request, stream, cancelled)
            finally:
                loop.call_soon_threadsafe(queue.put_nowait, _WORK_DONE)

        job = self.engine.worker.async_submit(work)
        job.add_done_callback(lambda future: future.cancelled() or future.exception())  # read even if nobody awaits
        created = int(time.time())

        def chunk(delta: ChoiceDelta, finish_reason: str | None = None, usage: CompletionUsage | None = None) -> str:
            event = ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, object="chat.completion.chunk",
                choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish_reason)], usage=usage,
            )
            return f"data: {event.model_dump_json(exclude_none=True)}\n\n"

        async def events():
            text, sent = StopTextFilter(request.stop), ""
            try:
                yield chunk(ChoiceDelta(role="assistant"))
                while (item := await queue.get()) is not _WORK_DONE:
                    if piece := text.feed(item):
                        sent += piece
                        yield chunk(ChoiceDelta(content=piece))
                try:
                    result = await job
                except ValueError as error:
                    yield _error_event(OpenAIError(400, str(error)))
                    return
                except Exception as error:  # the stream has started: report it in the stream, keep serving
                    yield _error_event(OpenAIError(500, f"Generation failed: {error}"))
                    return
                # What the stream held back: a possible stop string's start, and bytes the incremental decoder never
                # completed (e.g. a character cut by max_tokens), which the whole answer's decode writes as U+FFFD.
                piece = result.content[len(sent) :] if result.content.startswith(sent) else text.flush()
                if piece:
                    yield chunk(ChoiceDelta(content=piece))
                yield chunk(ChoiceDelta(), finish_reason=result.finish_reason, usage=_usage(result))
                yield "data: [DONE]\n\n"
            except (GeneratorExit, asyncio.CancelledError):
                if not job.done():
                    self.cancelled_streams += 1
                cancelled.set()  # the client left: stop generating (or never start)
                raise

        return StreamingResponse(events(), media_type="text/event-stream")


def build_app(engine: ChatEngine, model_name: str) -> FastAPI:
    """The FastAPI application: `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`."""
    handler = ChatCompletions(engine, model_name)
    created = int(time.time())
    app = FastAPI(title="bitune-serve")
    app.state.handler = handler

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, error: OpenAIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(error.status_code, str(error.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, error: RequestValidationError) -> JSONResponse:
        return OpenAIError(400, f"Invalid request: {error.errors()}").response()

    @app.exception_handler(Exception)
    async def server_error(_request: Request, error: Exception) -> JSONResponse:
        return OpenAIError(500, f"Internal error: {type(error).__name__}: {error}").response()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise OpenAIError(400, f"The request body is not valid JSON: {error}.") from error
        if not isinstance(body, dict):
            raise OpenAIError(400, f"The request body must be a JSON object, got {type(body).__name__}.")
        return await handler.handle_request(body, f"chatcmpl-{uuid.uuid4().hex}")

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "peft-bitune"}]}

    @app.get("/health")
    async def health() -> dict:
        store = engine.store
        return {"status": "ok", "kept_conversations": len(store), "kept_cache_bytes": store.nbytes,
                "cache_budget_bytes": store.max_bytes, "cancelled_streams": handler.cancelled_streams}

    return app


def _error_event(error: OpenAIError) -> str:
    """An error inside a stream that has started (its status line was sent): OpenAI's error object as an event."""
    return f"data: {json.dumps(error.body())}\n\n"


def _text_messages(messages: list[dict]) -> list[dict]:
    """The messages as a chat template takes them: text parts joined into one string with spaces (as `transformers
    serve` does for text-only models)."""
    texts = [m["content"] if isinstance(m.get("content"), str) else " ".join(p["text"] for p in m.get("content") or [])
             for m in messages]
    return [{"role": message["role"], "content": text} for message, text in zip(messages, texts)]


def _usage(result: ChatResult) -> CompletionUsage:
    completion_tokens = len(result.answer_ids)
    return CompletionUsage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=result.prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=result.cached_tokens),
    )


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "`messages` must be a non-empty list of {role, content} objects.", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or set(message) - {"role", "content"} or "role" not in message:
            raise OpenAIError(
                400, f"`{where}` must be an object with `role` and `content` only, got {message!r}.", where
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


def _optional_number(body: dict, name: str, kind: type, low: float | None = None, high: float | None = None) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise OpenAIError(400, f"`{name}` must be a{'n integer' if kind is int else ' number'}, got {value!r}.", name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise OpenAIError(400, f"`{name}` must be {bounds}, got {value!r}.", name)
    return kind(value)


def _check_stop(stop: Any) -> list[str]:
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    well_formed = isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
    if not well_formed or len(stops) > MAX_STOP_STRINGS:
        raise OpenAIError(
            400, f"`stop` must be a non-empty string or a list of up to {MAX_STOP_STRINGS} of them, got {stop!r}.",
            "stop",
        )
    return stops
