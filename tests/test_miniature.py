"""The miniature (examples/miniature): the committed base loads offline, the generated data is deterministic, and the
experiment runs end to end with tuned models ahead of the untuned base (which method wins is not asserted)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MINIATURE = Path(__file__).resolve().parents[1] / "examples" / "miniature"
BASE = MINIATURE / "base"


def _load(name: str):
    """A module of examples/miniature (they import each other by file name, as when run as scripts)."""
    spec = importlib.util.spec_from_file_location(f"miniature_{name}", MINIATURE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is created
    sys.path.insert(0, str(MINIATURE))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(MINIATURE))
    return module


@pytest.fixture(scope="module")
def base():
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # set by conftest: nothing may come from the Hub
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(BASE)
    return model, tokenizer


def test_base_loads_offline_with_its_tokenizer(base):
    model, tokenizer = base
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == len(tokenizer)
    assert (BASE / "model.safetensors").stat().st_size < 8 * 2**20
    assert tokenizer.padding_side == "left"
    for token in ("pad", "bos", "eos"):
        assert getattr(tokenizer, f"{token}_token_id") == getattr(model.config, f"{token}_token_id") is not None
    ids = tokenizer("Answer: 7")["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Answer: 7"
    # Unseen names still encode (byte-level BPE), and an answer's leading space survives a round trip.
    assert tokenizer.decode(tokenizer(" Zuxo", add_special_tokens=False)["input_ids"]) == " Zuxo"


def test_base_is_pretrained(base):
    """Fresh documents of the pretraining distribution (another seed) are far better predicted than by chance."""
    model, tokenizer = base
    pretrain = _load("pretrain")
    documents = pretrain.generate_corpus(16, seed=12345)
    batch = tokenizer(documents, return_tensors="pt", padding=True, padding_side="right")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    with torch.no_grad():
        loss = model(**batch, labels=labels).loss.item()
    assert loss < 0.5 * math.log(len(tokenizer)), loss


def test_corpus_and_suite_are_deterministic_and_held_out():
    pretrain, tasks, world = _load("pretrain"), _load("tasks"), _load("world")
    assert pretrain.generate_corpus(50, seed=3) == pretrain.generate_corpus(50, seed=3)
    assert pretrain.generate_corpus(50, seed=3) != pretrain.generate_corpus(50, seed=4)
    seen, held_out = world.entities("pretrain"), world.entities("heldout")
    assert not set(seen.people) & set(held_out.people) and not set(seen.towns) & set(held_out.towns)
    assert held_out.people and held_out.towns

    corpus = " ".join(pretrain.generate_corpus(2000, seed=0))
    test = tasks.make_split("test", 20)
    assert test == tasks.make_split("test", 20)
    assert {e.task for e in test} == set(tasks.TASKS)
    for example in test:
        assert example.prompt.endswith("Answer:") and example.completion.startswith(" ")
        if example.is_multiple_choice:
            assert example.completion == " " + example.choices[example.label]
        else:
            assert example.completion.strip().isdigit()
    # The suite's layout is not in the pretraining corpus, and neither are its people.
    assert "Story:" not in corpus and "Ask:" not in corpus
    assert not any(name in corpus for name in held_out.people[:200])


@pytest.mark.slow
def test_committed_tokenizer_is_what_pretrain_py_builds(tmp_path):
    """The committed base's corpus and tokenizer come from `pretrain.py` at its defaults (the tokenizer is trained on
    the whole generated corpus, so any change to the corpus shows here)."""
    pretrain = _load("pretrain")
    args = pretrain.parse_args([])
    recorded = json.loads((BASE / "pretraining.json").read_text())["arguments"]
    assert {k: v for k, v in vars(args).items() if k != "output_dir"} == {
        k: v for k, v in recorded.items() if k != "output_dir"
    }
    corpus = pretrain.generate_corpus(
        args.documents, args.seed, args.text_fraction, args.repeat_fraction, args.max_questions
    )
    pretrain.build_tokenizer(corpus, args.vocab_size).save_pretrained(tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == json.loads((BASE / "tokenizer.json").read_text())


def test_committed_data_is_the_generated_suite():
    """examples/miniature/data/*.jsonl (what the quickstart loads) is exactly what `tasks.py` generates."""
    tasks = _load("tasks")
    for split, rows_per_task in tasks.DATA_SIZES.items():
        committed = [json.loads(line) for line in (MINIATURE / "data" / f"{split}.jsonl").read_text().splitlines()]
        generated = [
            {**vars(e), "choices": list(e.choices)} for e in tasks.make_split(split, rows_per_task)
        ]
        assert committed == generated, f"{split}.jsonl is stale: run `python examples/miniature/tasks.py --write_data`"


@pytest.mark.slow
def test_small_run_end_to_end(tmp_path):
    """`run.py --small`: LoRA and Bitune are tuned and scored; each tuned model beats the untuned base on average."""
    output = tmp_path / "results.json"
    completed = subprocess.run(
        [sys.executable, str(MINIATURE / "run.py"), "--small", "--json", str(output)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    results = json.loads(output.read_text())
    base_average = results["base"]["tasks"]["average"]
    assert set(results["methods"]) == {"lora", "bitune"}
    for name, method in results["methods"].items():
        for seed in method["seeds"].values():
            assert set(seed["tasks"]) == {"membership", "count", "position", "category", "sum", "average"}
            assert seed["tasks"]["average"] > base_average, (name, seed["tasks"], results["base"]["tasks"])
    assert "| **Average** |" in completed.stdout and "Bitune" in completed.stdout
