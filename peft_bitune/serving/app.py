"""The OpenAI-compatible HTTP API of `bitune-serve` (FastAPI).

Requests are checked here (`validation.py`) and answered with OpenAI's own response types (the `openai` package's
`ChatCompletion`, and `ChatCompletionChunk` as server-sent events when streaming) or OpenAI's JSON error objects. The
server guards itself (`ServerSettings`, as vLLM's server does and a little more): API keys on every `/v1` call, JSON
bodies only and of bounded size (so that no web page a user visits can drive it with a plain form post), no CORS
headers and no `/docs` unless asked for. Rendering and tokenizing run on FastAPI's thread pool (several at once, so
that one request's preparation never holds back another's), and the model on the engine's worker thread, so the event
loop stays free for other clients (and `/health`) while a long request is prepared or answered.
"""

# No `from __future__ import annotations`: FastAPI reads the chat endpoint's body type, made per server, at runtime.
import asyncio
import copy
import json
import secrets
import threading
import time
import uuid
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.sse import EventSourceResponse, format_sse_event
from jinja2 import TemplateError
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from openai.types.completion_usage import CompletionUsage, PromptTokensDetails
from starlette.exceptions import HTTPException as StarletteHTTPException

from .engine import ChatEngine, ChatRequest, ChatResult
from .prompts import PromptLayoutError
from .settings import ServerSettings
from .streaming import StopTextFilter, TextStream
from .validation import ChatCompletionRequest, OpenAIError, check_request, refusal

_WORK_DONE = object()  # queued after the worker finished a streaming request, whatever happened
PREPARATION_THREADS = 4  # requests checked, rendered and tokenized at once (on FastAPI's thread pool)
# Below this temperature a request is answered greedily, as at 0 (vLLM's threshold too): sampling is greedy there but
# for near-ties, and dividing the logits by a temperature below about 1e-38 overflows float32, which sampling refuses.
GREEDY_BELOW_TEMPERATURE = 1e-5


class ChatCompletions:
    """`POST /v1/chat/completions` over a `ChatEngine`: validation, then one request queued on the model worker."""

    def __init__(self, engine: ChatEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.cancelled_streams = 0  # streams whose client left before the answer was complete
        self._preparing = asyncio.Semaphore(PREPARATION_THREADS)

    async def handle_request(self, body: ChatCompletionRequest, request_id: str,
                             api_key: int | None = None) -> JSONResponse | EventSourceResponse:
        async with self._preparing:
            request = await run_in_threadpool(self.chat_request, body, api_key)
        if body.stream:
            return self._stream(request, request_id)
        try:
            result = await asyncio.wrap_future(self.engine.submit(request))
        except ValueError as error:  # a check of `generate` (e.g. positions): the request's fault
            raise OpenAIError(400, str(error)) from error
        message = ChatCompletionMessage(role="assistant", content=result.content)
        completion = ChatCompletion(
            id=request_id, created=int(time.time()), object="chat.completion", model=self.model_name,
            choices=[Choice(index=0, finish_reason=result.finish_reason, message=message)], usage=_usage(result),
        )
        return JSONResponse(completion.model_dump(exclude_none=True))

    def chat_request(self, body: ChatCompletionRequest | dict, api_key: int | None = None) -> ChatRequest:
        """Lay out a request's conversation (a body given as a dict is checked first); raises `OpenAIError` for
        anything wrong. It may reuse the conversations kept for its API key, `user` and `prompt_cache_key` only."""
        checked = body if isinstance(body, ChatCompletionRequest) else check_request(body, self.model_name)
        max_tokens = checked.answer_tokens
        partition = (api_key, checked.user, checked.prompt_cache_key)
        texts = checked.text_messages()
        fewest = self.engine.fewest_tokens(texts)  # before any rendering: cheap, and linear in the request
        if not self.engine.room_for(fewest, max_tokens):
            characters = sum(len(message["content"]) for message in texts)
            raise self._too_long(f"at least {fewest} tokens ({len(texts)} messages of {characters} characters)",
                                 max_tokens)
        try:
            prompt = self.engine.prompts.build(texts)
        except TemplateError as error:
            raise OpenAIError(400, f"The chat template refused the messages: {error}", "messages") from error
        except PromptLayoutError as error:
            raise OpenAIError(400, str(error), "messages") from error
        if not self.engine.room_for(len(prompt), max_tokens):
            raise self._too_long(f"{len(prompt)} tokens", max_tokens)
        # Seeded on the worker, right before this request runs: seeding here would reseed whatever runs meanwhile.
        generation_config = self._generation_config(checked.temperature, checked.top_p)
        return ChatRequest(prompt, generation_config, max_tokens, checked.stop_strings, checked.seed, partition)

    def _too_long(self, taken: str, max_tokens: int | None) -> OpenAIError:
        return OpenAIError(
            400,
            f"This model's maximum context length is {self.engine.max_positions} tokens; the messages take {taken} "
            f"and {max_tokens or 1} more are asked for. Shorten the conversation or lower `max_tokens` (nothing is "
            "truncated silently).",
            "messages", "context_length_exceeded",
        )

    def _generation_config(self, temperature: float | None, top_p: float | None) -> Any:
        """The model's generation config with the request's settings: greedy at temperature 0 (and below
        `GREEDY_BELOW_TEMPERATURE`, whatever `top_p`), sampling at any other temperature or `top_p` (as OpenAI does),
        the model's own choice when neither is given."""
        generation_config = copy.deepcopy(self.engine.model.generation_config)
        generation_config.stop_strings = None  # the request's own, in `ChatRequest.stop` (`streaming.StopStrings`)
        if temperature is not None and temperature < GREEDY_BELOW_TEMPERATURE:
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

    def _stream(self, request: ChatRequest, request_id: str) -> EventSourceResponse:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancelled = threading.Event()
        stream = TextStream(self.engine.tokenizer, lambda text: loop.call_soon_threadsafe(queue.put_nowait, text))

        work = self.engine.submit(request, stream, cancelled)
        # Queued after the stream's last text (both go through the loop in order), whatever happened to the work.
        work.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, _WORK_DONE))
        job = asyncio.wrap_future(work)
        job.add_done_callback(lambda future: future.cancelled() or future.exception())  # read even if nobody awaits
        created = int(time.time())

        def chunk(delta: ChoiceDelta, finish_reason: str | None = None, usage: CompletionUsage | None = None) -> bytes:
            event = ChatCompletionChunk(
                id=request_id, created=created, model=self.model_name, object="chat.completion.chunk",
                choices=[ChunkChoice(index=0, delta=delta, finish_reason=finish_reason)], usage=usage,
            )
            return format_sse_event(data_str=event.model_dump_json(exclude_none=True))

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
                yield format_sse_event(data_str="[DONE]")
            except (GeneratorExit, asyncio.CancelledError):
                if not job.done():
                    self.cancelled_streams += 1
                cancelled.set()  # the client left: stop generating (or never start)
                raise

        return EventSourceResponse(events())


def build_app(engine: ChatEngine, model_name: str, settings: ServerSettings | None = None) -> FastAPI:
    """The FastAPI application: `POST /v1/chat/completions`, `GET /v1/models`, `GET /health`."""
    settings = settings or ServerSettings()
    handler = ChatCompletions(engine, model_name)
    created = int(time.time())
    app = FastAPI(title="bitune-serve", docs_url="/docs" if settings.docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if settings.docs else None)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(OpenAIError)
    async def openai_error(_request: Request, error: OpenAIError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
        return error.response(headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, error: RequestValidationError) -> JSONResponse:
        return refusal(error.errors()).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException) -> JSONResponse:
        cause = f": {error.__cause__}" if error.__cause__ else ""  # e.g. FastAPI's "error parsing the body": why
        return OpenAIError(error.status_code, f"{error.detail}{cause}").response()

    @app.exception_handler(Exception)
    async def server_error(_request: Request, error: Exception) -> JSONResponse:
        return OpenAIError(500, f"Internal error: {type(error).__name__}: {error}").response()

    bearer = HTTPBearer(auto_error=False)  # refused below, in OpenAI's error shape

    def authorized_key(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> int | None:
        """The index of the API key the request carries (None when the server has no keys); 401 otherwise."""
        if not settings.api_keys:
            return None
        given = credentials.credentials.encode("utf-8") if credentials is not None else b""
        matches = [secrets.compare_digest(key.encode("utf-8"), given) for key in settings.api_keys]  # all compared
        if not any(matches):
            raise OpenAIError(
                401, "Incorrect or missing API key: send `Authorization: Bearer <key>` with a key this server was "
                "started with (--api-key or BITUNE_SERVE_API_KEY).", code="invalid_api_key",
            )
        return matches.index(True)

    v1 = APIRouter(prefix="/v1")

    async def chat_completions(
        body: ChatCompletionRequest.serving(model_name), api_key: int | None = Depends(authorized_key)
    ) -> Any:
        return await handler.handle_request(body, f"chatcmpl-{uuid.uuid4().hex}", api_key)

    v1.add_api_route("/chat/completions", chat_completions, methods=["POST"],
                     route_class_override=_json_body_route(settings.max_request_bytes))

    @v1.get("/models")
    async def models(_api_key: int | None = Depends(authorized_key)) -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "peft-bitune"}]}

    app.include_router(v1)

    @app.get("/health")
    async def health() -> dict:
        store = engine.store
        return {"status": "ok", "kept_conversations": len(store), "kept_cache_bytes": store.nbytes,
                "cache_budget_bytes": store.max_bytes, "cancelled_streams": handler.cancelled_streams,
                "batch_sizes": engine.worker.batch_size_counts()}

    return app


def _json_body_route(max_bytes: int) -> type[APIRoute]:
    """A route that reads its body itself before FastAPI does (FastAPI's own `max_body_size` needs a FastAPI far above
    this extra's floor, and answers in plain text): JSON only, and at most `max_bytes`."""

    class JSONBodyRoute(APIRoute):
        def get_route_handler(self) -> Any:
            handle = super().get_route_handler()

            async def read_then_handle(request: Request) -> Response:
                return await handle(_ReadRequest(request, await _read_json_body(request, max_bytes)))

            return read_then_handle

    return JSONBodyRoute


class _ReadRequest(Request):
    """A request whose body was read already: FastAPI parses it from here (FastAPI's documented custom request)."""

    def __init__(self, request: Request, body: bytes) -> None:
        super().__init__(request.scope, request.receive)
        self._read = body

    async def body(self) -> bytes:
        return self._read


async def _read_json_body(request: Request, max_bytes: int) -> bytes:
    """The body of a JSON request, refused (415) unless it says it is JSON (so that no web page can post a form to
    the server), and (413) as soon as it is known to be larger than `max_bytes`: from its Content-Length, or while it
    arrives. Pydantic cannot express either: FastAPI would read the whole body first."""
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise OpenAIError(
            415, f"Request bodies must be JSON, sent with `Content-Type: application/json` (got "
            f"{media_type or 'none'!r}).",
        )
    too_large = OpenAIError(
        413, f"The request body is larger than this server's limit of {max_bytes} bytes (--max-request-bytes).",
        code="request_too_large",
    )
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > max_bytes:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def _error_event(error: OpenAIError) -> bytes:
    """An error inside a stream that has started (its status line was sent): OpenAI's error object as an event."""
    return format_sse_event(data_str=json.dumps(error.body()))


def _usage(result: ChatResult) -> CompletionUsage:
    prompt_tokens, completion_tokens = result.prompt_tokens, len(result.answer_ids)
    return CompletionUsage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens,
                           prompt_tokens_details=PromptTokensDetails(cached_tokens=result.cached_tokens))
