"""`bitune-serve`: an OpenAI-compatible chat server for a Bitune adapter.

    bitune-serve --model BASE --adapter ADAPTER [--chat-template FILE] [--host 127.0.0.1] [--port 8000]
                 [--api-key KEY] [--allowed-origins ORIGIN ...] [--max-request-bytes N] [--docs]
                 [--max-batch-size N] [--max-batch-tokens N]

`transformers serve` cannot load a Bitune adapter (it loads models with `from_pretrained`), and vLLM, TGI and llama.cpp
cannot prefill a prompt twice with two weight sets; see docs/serving.md.

Everything that can be wrong at startup is checked before the model's weights are read, cheapest first (the device,
the port, the adapter's config, the chat template), and refused with one line that says what to do.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import socket
import sys
from collections.abc import Sequence
from typing import Any

from ..constants import is_bitune_type, peft_type_name
from ..utils.command_line_numbers import number_problem
from .settings import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MAX_BATCH_TOKENS,
    DEFAULT_MAX_REQUEST_BYTES,
    BatchLimits,
    ServerSettings,
    api_key_problem,
)

DEFAULT_CACHE_MEMORY_MB = 1024
API_KEY_VARIABLE = "BITUNE_SERVE_API_KEY"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bitune-serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="The base model: a folder or a Hub id.")
    parser.add_argument("--adapter", required=True, help="The Bitune adapter: a folder or a Hub id.")
    parser.add_argument(
        "--chat-template",
        default=None,
        help="A file with a Jinja chat template, for a tokenizer that has none (or to replace its own).",
    )
    parser.add_argument("--served-model-name", default=None,
                        help="The model name clients send in `model` (default: the --adapter value).")
    parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (default: this machine only).")
    parser.add_argument("--port", type=int, default=8000, help="Port to listen on; 0 picks a free one.")
    parser.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help=f"Require `Authorization: Bearer KEY` on every /v1 call; give it again for more keys "
                        f"(each keeps its own conversations). Default: the {API_KEY_VARIABLE} environment variable.")
    parser.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                        help="Web origins (e.g. https://app.example.com) allowed to call the server from a browser "
                        "(CORS). Default: none.")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="The largest request body accepted (default: 4 MiB); larger ones get 413 unread.")
    parser.add_argument("--docs", action="store_true", help="Serve the interactive API docs at /docs.")
    parser.add_argument("--cache-memory-mb", type=float, default=DEFAULT_CACHE_MEMORY_MB,
                        help="Memory for kept conversation caches, least recently used dropped first; 0 keeps none.")
    parser.add_argument("--max-batch-size", type=int, default=DEFAULT_MAX_BATCH_SIZE,
                        help=f"The most requests answered together: requests that arrive while the model is busy are "
                        f"answered in one batch next (default: {DEFAULT_MAX_BATCH_SIZE}; 1: one at a time).")
    parser.add_argument("--max-batch-tokens", type=int, default=DEFAULT_MAX_BATCH_TOKENS,
                        help="The most tokens a batch's padded cache may grow to: its rows times (its longest prompt "
                        "plus the most tokens any of its answers may take); a larger request is answered alone "
                        f"(default: {DEFAULT_MAX_BATCH_TOKENS}).")
    parser.add_argument("--device", default="cpu", help="torch device for the model, e.g. cpu, cuda, cuda:1.")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="Model dtype ('auto': as saved).")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level.")
    args = parser.parse_args(argv)
    check_numbers(args)
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        parser.error(f"--chat-template {args.chat_template!r} is not a file.")
    if args.api_key is None:
        args.api_key = [os.environ[API_KEY_VARIABLE]] if os.environ.get(API_KEY_VARIABLE) else []
    for key in args.api_key:
        if problem := api_key_problem(key):
            raise fail(f"--api-key (or {API_KEY_VARIABLE}): {problem}")
    return args


def check_numbers(args: argparse.Namespace) -> None:
    """Refuse a numeric flag that parsed but cannot be used (nan, inf, an overflow) or is out of its range, with one
    line."""
    for flag in ("port", "max_request_bytes", "cache_memory_mb", "max_batch_size", "max_batch_tokens"):
        if problem := number_problem(getattr(args, flag)):
            raise fail(f"--{flag.replace('_', '-')} {problem}.")
    if not 0 <= args.port <= 65535:
        raise fail(f"--port must be between 0 and 65535, got {args.port}.")
    if args.cache_memory_mb < 0 or not math.isfinite(args.cache_memory_mb * 2**20):
        raise fail(f"--cache-memory-mb must be 0 or more (and a number of megabytes a float can hold in bytes), got "
                   f"{args.cache_memory_mb}.")
    for flag in ("max_request_bytes", "max_batch_size", "max_batch_tokens"):
        if getattr(args, flag) < 1:
            raise fail(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}.")


def fail(message: str) -> SystemExit:
    """The one line `bitune-serve` exits with."""
    return SystemExit(f"bitune-serve: {' '.join(message.split())}")


def check_device(name: str) -> None:
    """Refuse a device torch cannot use here, before any weights are read."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise fail(f"--device {name!r} is not a torch device ({error}); use e.g. cpu, cuda or cuda:1.") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a build without CUDA"
            raise fail(f"--device {name}, but CUDA is not available here (torch {torch.__version__}, {build}, no GPU "
                       "visible). Use --device cpu, or install a CUDA build of torch on a machine with a GPU.")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise fail(f"--device {name}, but only {torch.cuda.device_count()} CUDA device(s) are visible; use "
                       f"cuda:0 to cuda:{torch.cuda.device_count() - 1}.")
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise fail(f"--device {name}, but MPS is not available here. Use --device cpu.")


def load_engine(args: argparse.Namespace) -> Any:
    """The tokenizer, adapter config and chat template first (all checked before any weights are read), then the
    model and adapter."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .engine import ChatEngine

    config = read_adapter_config(args.adapter)
    if not is_bitune_type(config.peft_type):
        raise fail(f"{args.adapter!r} is a {peft_type_name(config.peft_type)} adapter, not a Bitune one; serve it "
                   "with vLLM or `transformers serve`.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.adapter)
    except (OSError, ValueError):
        try:
            tokenizer = AutoTokenizer.from_pretrained(args.model)
        except (OSError, ValueError) as error:
            raise fail(f"cannot load a tokenizer from the adapter {args.adapter!r} or the base model {args.model!r}: "
                       f"{error}.") from None
    chat_template = None
    if args.chat_template is not None:
        with open(args.chat_template, encoding="utf-8") as file:
            chat_template = file.read()
    if chat_template is None and not tokenizer.chat_template:
        raise fail(f"the tokenizer of {args.adapter!r} has no chat template, so conversations cannot be rendered. "
                   "Pass one with `--chat-template <file>` (a Jinja template, e.g. the one your adapter was trained "
                   "with).")
    check_chat_template(tokenizer, chat_template, config.multi_turn, args.chat_template)
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    try:
        base = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    except (OSError, ValueError) as error:
        raise fail(f"cannot load the base model {args.model!r}: {error}.") from None
    try:
        model = PeftModel.from_pretrained(base.to(args.device), args.adapter)
    except Exception as error:  # safetensors, PEFT and our own checks: all a file the user must fix
        detail = str(error).rstrip()
        detail += "" if detail.endswith(".") else "."
        # The project's own refusals (ValueError) already say what to do; a raw library error gets the likely fix.
        hint = ""
        if not isinstance(error, ValueError):
            hint = " If the file is truncated or corrupt, save (or download) the adapter again."
        message = f"cannot load the adapter weights of {args.adapter!r}: {type(error).__name__}: {detail}{hint}"
        raise fail(message) from None
    limits = BatchLimits(args.max_batch_size, args.max_batch_tokens)
    return ChatEngine(model.eval(), tokenizer, chat_template, int(args.cache_memory_mb * 2**20), limits)


def read_adapter_config(adapter: str) -> Any:
    """The adapter's PEFT config; an adapter that has none, or whose adapter_config.json is not a PEFT config (not
    JSON, not an object, no `peft_type`, on which PEFT fails with a `TypeError` or `KeyError`), is refused in one line
    that names the file and what is wrong with it."""
    from peft import PeftConfig

    import peft_bitune  # noqa: F401  (registers the BITUNE adapter type; without it: KeyError: 'BITUNE')

    try:
        return PeftConfig.from_pretrained(adapter)
    except (OSError, ValueError, TypeError, KeyError) as error:
        problem = config_file_problem(adapter)
        if problem is None:
            raise fail(f"cannot read the adapter {adapter!r}: {error}. Pass a folder saved with `save_pretrained` (it "
                       "holds adapter_config.json) or a Hub id of one.") from None
        raise fail(f"cannot read the adapter {adapter!r}: {problem}. Save (or download) the adapter again, or restore "
                   "the file.") from None


def config_file_problem(adapter: str) -> str | None:
    """What is wrong with the adapter_config.json of a local adapter folder, or None (no such file, or nothing found
    wrong with it here)."""
    import json

    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    path = os.path.join(adapter, "adapter_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{path} is {'empty' if os.path.getsize(path) == 0 else f'not valid JSON ({error})'}"
    if not isinstance(data, dict):
        return (f"{path} must hold a JSON object of config fields ({{\"peft_type\": \"BITUNE\", ...}}), but holds "
                f"`{json.dumps(data)[:40]}`")
    if "peft_type" not in data:
        return (f"{path} has no `peft_type`, so it does not say which adapter method it holds (a Bitune adapter's "
                "is \"BITUNE\")")
    peft_type = data["peft_type"]
    if not isinstance(peft_type, str) or peft_type not in PEFT_TYPE_TO_CONFIG_MAPPING:
        return (f"{path} has the `peft_type` {json.dumps(peft_type)[:40]}, which is no adapter method PEFT knows here "
                "(a Bitune adapter's is \"BITUNE\")")
    return None


def check_chat_template(tokenizer: Any, chat_template: str | None, multi_turn: str, path: str | None) -> None:
    """Compile and render the template once on a plain conversation (and, for an alternating adapter, find its
    answers by its `{% generation %}` markers or TRL's), so that a template that is broken, or that training could not
    have used, stops the server now rather than failing every request."""
    from jinja2 import TemplateError

    from .prompts import PromptBuilder, PromptLayoutError

    where = f"--chat-template {path!r}" if path else "the tokenizer's chat template"
    try:
        PromptBuilder(tokenizer, chat_template, multi_turn).check()
    except TemplateError as error:
        line = f" (line {error.lineno})" if getattr(error, "lineno", None) else ""
        raise fail(f"{where} fails on a plain conversation: {type(error).__name__}: {str(error).rstrip('.')}{line}. "
                   "Fix the template.") from None
    except PromptLayoutError as error:
        raise fail(f"{where} cannot be used with this adapter (multi_turn={multi_turn!r}): {error}") from None


def bind_or_fail(host: str, port: int) -> socket.socket:
    from .server import bind

    try:
        return bind(host, port)
    except socket.gaierror as error:
        raise fail(f"--host {host!r} is not an address of this machine ({error}); use e.g. 127.0.0.1 or 0.0.0.0.") \
            from None
    except OSError as error:
        raise fail(f"cannot listen on {host}:{port}: {error.strerror or error}. Stop whatever uses that port, or "
                   "pick another with --port (0 picks a free one).") from None


def precision_note(dtype: str, max_batch_size: int) -> str | None:
    """The startup note of a server whose batches may change greedy answers: in bfloat16 and float16 a padded batch
    sums in another order than a request alone, and a near-tie between two tokens can flip (docs/serving.md,
    "Precision"). None where every answer is the same alone and in a batch (float32, or one request at a time)."""
    if dtype not in ("bfloat16", "float16") or max_batch_size == 1:
        return None
    return (f"bitune-serve: note: in {dtype}, a greedy answer in a batch can differ from the same request answered "
            "alone (a padded batch sums in another order; docs/serving.md gives the measured rate). --dtype float32, "
            "or --max-batch-size 1, answers every request exactly as alone.")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        from .app import build_app
        from .server import serve, url_of
    except ImportError as error:
        raise fail(f"bitune-serve needs FastAPI, uvicorn and openai: `pip install 'peft-bitune[serve]'` ({error}).")
    check_device(args.device)
    sock = bind_or_fail(args.host, args.port)  # before the model loads: a port in use is known in a second
    try:
        engine = load_engine(args)
    except BaseException:
        sock.close()
        raise
    if note := precision_note(str(engine.model.dtype).removeprefix("torch."), args.max_batch_size):
        print(note, file=sys.stderr, flush=True)
    if not args.api_key and not is_loopback(args.host):
        print(f"bitune-serve: warning: listening on {args.host} without --api-key: anyone who can reach this port can "
              "use the model. Set --api-key (or BITUNE_SERVE_API_KEY).", file=sys.stderr, flush=True)
    settings = ServerSettings(api_keys=tuple(args.api_key), allowed_origins=tuple(args.allowed_origins),
                              docs=args.docs, max_request_bytes=args.max_request_bytes)
    name = args.served_model_name or args.adapter
    print(f"bitune-serve: serving {name} on {url_of(sock)}", flush=True)
    serve(build_app(engine, name, settings), sock, args.log_level)


if __name__ == "__main__":
    main()
    sys.exit(0)
