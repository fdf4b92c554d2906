"""`python -m vllm_integration ADAPTER [--chat-template FILE] [--option value ...]`: prints the arguments of vLLM's
OpenAI-compatible server that serve the Bitune adapter (`server_arguments`), for `vllm serve $(...)`."""

from __future__ import annotations

import argparse
import shlex

from .engine import server_arguments


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vllm_integration", description=__doc__)
    parser.add_argument("adapter", help="the Bitune adapter folder or Hub id")
    parser.add_argument("--chat-template", help="a chat template file (default: the base tokenizer's)")
    parser.add_argument("--dtype")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    args = parser.parse_args(argv)
    options = {name: value for name, value in vars(args).items()
               if name not in ("adapter", "chat_template") and value is not None}
    print(shlex.join(server_arguments(args.adapter, chat_template=args.chat_template, **options)))


if __name__ == "__main__":
    main()
