"""`bitune-serve`: an OpenAI-compatible chat server for a Bitune adapter.

    bitune-serve --model BASE --adapter ADAPTER [--chat-template FILE] [--host 127.0.0.1] [--port 8000]

`transformers serve` cannot load a Bitune adapter (it loads models with `from_pretrained`), and vLLM, TGI and llama.cpp
cannot prefill a prompt twice with two weight sets; see docs/serving.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..common import is_bitune_type, peft_type_name

DEFAULT_CACHE_MEMORY_MB = 1024


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
    parser.add_argument("--cache-memory-mb", type=float, default=DEFAULT_CACHE_MEMORY_MB,
                        help="Memory for kept conversation caches, least recently used dropped first; 0 keeps none.")
    parser.add_argument("--device", default="cpu", help="torch device for the model, e.g. cpu, cuda, cuda:1.")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="Model dtype ('auto': as saved).")
    parser.add_argument("--log-level", default="warning", help="uvicorn log level.")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be between 0 and 65535, got {args.port}.")
    if args.cache_memory_mb < 0:
        parser.error(f"--cache-memory-mb must be 0 or more, got {args.cache_memory_mb}.")
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        parser.error(f"--chat-template {args.chat_template!r} is not a file.")
    return args


def load_engine(args: argparse.Namespace):
    """The tokenizer and chat template first (refused before any weights are read), then the model and adapter."""
    import torch
    from peft import PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import peft_bitune  # noqa: F401  (registers the BITUNE adapter type; without it: KeyError: 'BITUNE')

    from .engine import ChatEngine

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.adapter)
    except (OSError, ValueError):
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    chat_template = None
    if args.chat_template is not None:
        with open(args.chat_template, encoding="utf-8") as file:
            chat_template = file.read()
    if chat_template is None and not tokenizer.chat_template:
        raise SystemExit(
            f"bitune-serve: the tokenizer of {args.adapter!r} has no chat template, so conversations cannot be "
            "rendered. Pass one with `--chat-template <file>` (a Jinja template, e.g. the one your adapter was "
            "trained with)."
        )
    peft_type = PeftConfig.from_pretrained(args.adapter).peft_type
    if not is_bitune_type(peft_type):
        raise SystemExit(
            f"bitune-serve: {args.adapter!r} is a {peft_type_name(peft_type)} adapter, not a Bitune one; serve it "
            "with vLLM or `transformers serve`."
        )
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device)
    model = PeftModel.from_pretrained(base, args.adapter)
    return ChatEngine(model.eval(), tokenizer, chat_template, int(args.cache_memory_mb * 2**20))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        from .app import build_app
        from .server import bind, serve, url_of
    except ImportError as error:
        raise SystemExit(
            f"bitune-serve needs FastAPI, uvicorn and openai: `pip install 'peft-bitune[serve]'` ({error})."
        )
    engine = load_engine(args)
    sock = bind(args.host, args.port)
    print(f"bitune-serve: serving {args.served_model_name or args.adapter} on {url_of(sock)}", flush=True)
    serve(build_app(engine, args.served_model_name or args.adapter), sock, args.log_level)


if __name__ == "__main__":
    main()
    sys.exit(0)
