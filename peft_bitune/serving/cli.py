"""`bitune-serve`: an OpenAI-compatible chat server for a Bitune adapter.

`transformers serve` cannot load a Bitune adapter (it loads models with `from_pretrained`), and vLLM, TGI and llama.cpp
cannot prefill a prompt twice with two weight sets; see docs/serving.md.

Everything that can be wrong at startup is checked before the model's weights are read, cheapest first (the device,
the port, the adapter's config, the chat template), and refused with one line that says what to do.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import math
import os
import re
import socket
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

from transformers import HfArgumentParser

from ..constants import is_bitune_type, peft_type_name
from ..utils.command_line_numbers import number_problem
from .settings import BatchLimits, ServerSettings

DEFAULT_CACHE_MEMORY_MB = 1024
API_KEY_VARIABLE = "BITUNE_SERVE_API_KEY"


@dataclass
class ServeArguments:
    """What to serve, where, and on what; with `ServerSettings` and `BatchLimits`, the options of `bitune-serve`."""

    model: str = field(metadata={"help": "The base model: a folder or a Hub id."})
    adapter: str = field(metadata={"help": "The Bitune adapter: a folder or a Hub id."})
    chat_template: str | None = field(default=None, metadata={
        "help": "A file with a Jinja chat template, for a tokenizer that has none (or to replace its own)."})
    served_model_name: str | None = field(default=None, metadata={
        "help": "The model name clients send in `model` (default: the --adapter value)."})
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on (default: this machine only)."})
    port: int = field(default=8000, metadata={"help": "Port to listen on; 0 picks a free one."})
    cache_memory_mb: float = field(default=DEFAULT_CACHE_MEMORY_MB, metadata={
        "help": "Memory for kept conversation caches, least recently used dropped first; 0 keeps none."})
    device: str = field(default="cpu", metadata={"help": "torch device for the model, e.g. cpu, cuda, cuda:1."})
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = field(default="auto", metadata={
        "help": "Model dtype ('auto': as saved)."})
    log_level: str = field(default="warning", metadata={"help": "uvicorn log level."})

    def __post_init__(self) -> None:
        for name in ("port", "cache_memory_mb"):
            if problem := number_problem(getattr(self, name)):
                raise ValueError(f"`{name}` {problem}.")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"`port` must be between 0 and 65535, got {self.port}.")
        if self.cache_memory_mb < 0 or not math.isfinite(self.cache_memory_mb * 2**20):
            raise ValueError(f"`cache_memory_mb` must be 0 or more (and a number of megabytes a float can hold in "
                             f"bytes), got {self.cache_memory_mb}.")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"`chat_template` {self.chat_template!r} is not a file.")


class Command(NamedTuple):
    """`bitune-serve`'s options, parsed and checked."""

    arguments: ServeArguments
    settings: ServerSettings
    limits: BatchLimits


OPTIONS = (ServeArguments, ServerSettings, BatchLimits)
# The flag of each option, for messages that name its field (`max_batch_size` -> --max-batch-size).
FLAGS = {f.name: f"--{f.name.replace('_', '-')}" for options in OPTIONS for f in dataclasses.fields(options)}
FLAGS["api_keys"] = f"--api-key (or {API_KEY_VARIABLE})"


def parse_args(argv: Sequence[str] | None = None) -> Command:
    """The options, parsed by transformers' `HfArgumentParser` from the dataclasses' fields, each checked by its
    dataclass as it is made (an API key from the environment too); anything wrong exits with one line."""
    parser = HfArgumentParser(OPTIONS, prog="bitune-serve", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    try:
        arguments, settings, limits, unknown = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
        if unknown:
            raise fail(f"unrecognized arguments: {' '.join(unknown)} (see `bitune-serve --help`).")
        if not settings.api_keys and os.environ.get(API_KEY_VARIABLE):
            settings = dataclasses.replace(settings, api_keys=[os.environ[API_KEY_VARIABLE]])
    except ValueError as error:  # the dataclasses name an option by its field, the command by its flag
        raise fail(re.sub(r"`(\w+)`", lambda name: FLAGS.get(name[1], name[0]), str(error))) from None
    return Command(arguments, settings, limits)


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


def load_engine(command: Command) -> Any:
    """The tokenizer, adapter config and chat template first (all checked before any weights are read), then the
    model and adapter."""
    args = command.arguments
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .engine import ChatEngine
    from .prompts import checked_prompt_builder

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
    chat_template = None if args.chat_template is None else Path(args.chat_template).read_text(encoding="utf-8")
    where = f"--chat-template {args.chat_template!r}" if args.chat_template else "the tokenizer's chat template"
    try:
        checked_prompt_builder(tokenizer, chat_template, config.multi_turn, where)
    except ValueError as error:
        raise fail(str(error)) from None
    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    try:
        base = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    except (OSError, ValueError) as error:
        raise fail(f"cannot load the base model {args.model!r}: {error}.") from None
    try:
        model = PeftModel.from_pretrained(base.to(args.device), args.adapter)
    except Exception as error:  # safetensors, PEFT and our own checks: all a file the user must fix
        # The project's own refusals (ValueError) already say what to do; a raw library error gets the likely fix.
        fix = " If the file is truncated or corrupt, save (or download) the adapter again."
        raise fail(f"cannot load the adapter weights of {args.adapter!r}: {type(error).__name__}: "
                   f"{str(error).rstrip().removesuffix('.')}.{'' if isinstance(error, ValueError) else fix}") from None
    return ChatEngine(model.eval(), tokenizer, chat_template, int(args.cache_memory_mb * 2**20), command.limits)


def read_adapter_config(adapter: str) -> Any:
    """The adapter's PEFT config; an adapter that has none, or whose adapter_config.json is not a PEFT config (on
    which PEFT fails with a `TypeError` or `KeyError`), is refused in one line that says what is wrong with it."""
    from peft import PeftConfig

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

    from ..persistence.config_files import read_json_object

    path = os.path.join(adapter, "adapter_config.json")
    if not os.path.isfile(path):
        return None
    try:
        data = read_json_object(path)
    except (OSError, ValueError) as error:
        return f"{path}: {error}"
    if "peft_type" not in data:
        return (f"{path} has no `peft_type`, so it does not say which adapter method it holds (a Bitune adapter's "
                "is \"BITUNE\")")
    peft_type = data["peft_type"]
    if not isinstance(peft_type, str) or peft_type not in PEFT_TYPE_TO_CONFIG_MAPPING:
        return (f"{path} has the `peft_type` {json.dumps(peft_type)[:40]}, which is no adapter method PEFT knows here "
                "(a Bitune adapter's is \"BITUNE\")")
    return None


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
    command = parse_args(argv)
    args, settings = command.arguments, command.settings
    try:
        from .app import build_app
        from .server import serve, url_of
    except ImportError as error:
        raise fail(f"bitune-serve needs FastAPI, uvicorn and openai: `pip install 'peft-bitune[serve]'` ({error}).")
    check_device(args.device)
    sock = bind_or_fail(args.host, args.port)  # before the model loads: a port in use is known in a second
    try:
        engine = load_engine(command)
    except BaseException:
        sock.close()
        raise
    if note := precision_note(str(engine.model.dtype).removeprefix("torch."), command.limits.max_batch_size):
        print(note, file=sys.stderr, flush=True)
    if not settings.api_keys and not is_loopback(args.host):
        print(f"bitune-serve: warning: listening on {args.host} without --api-key: anyone who can reach this port can "
              "use the model. Set --api-key (or BITUNE_SERVE_API_KEY).", file=sys.stderr, flush=True)
    name = args.served_model_name or args.adapter
    print(f"bitune-serve: serving {name} on {url_of(sock)}", flush=True)
    serve(build_app(engine, name, settings), sock, args.log_level)


if __name__ == "__main__":
    main()
    sys.exit(0)
