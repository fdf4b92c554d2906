"""Evaluation: the harness model `bitune` against the training forward, the paper's task formats and harness tasks,
chain-of-thought answers and their metric, `bitune-eval`, and the seeds example.

Nothing is downloaded: tasks are YAML files written here over local JSONL files, the tokenizer is a character-level
one built here (its vocabulary has exactly the tiny models' size, so the harness never resizes the embeddings)."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from lm_eval import simple_evaluate
from lm_eval.api.instance import Instance
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from compat_helpers import from_project, needs_cache_name, only_cache_argument, renamed_name_warnings
from peft_bitune.evaluation import (
    PAPER_TASKS,
    TASKS_DIR,
    NumericExactMatch,
    answers_match,
    extract_final_answer,
    format_cot_answer,
    format_dataset,
    get_task,
    normalize_number,
    split_cot_answer,
)
from peft_bitune.evaluation.cli import main as bitune_eval
from peft_bitune.evaluation.cli import with_paper_tasks
from peft_bitune.evaluation.harness import BituneLM, PrefillOnceLM
from reference import make_bitune, reference_greedy
from tiny_models import VOCAB

BOS = 1
CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,?!:;'\"-\n()$%#=+*/"

# Multiple-choice documents: two share a context (one prefill for both), one has a two-token context, one an empty
# context (the harness puts the BOS token there: a one-token instruction, nothing to prefill), and one has more
# choices than the batch size of 3.
MC_DOCS = [
    {"instruction": "Question: Which is a fruit?\n\nAnswer:", "choices": ["apple", "chair"], "label": 0},
    {"instruction": "Question: Which is a fruit?\n\nAnswer:", "choices": ["pear", "stone", "cloud"], "label": 0},
    {"instruction": "Q", "choices": ["a", "bb", "ccc", "dddd"], "label": 2},
    {"instruction": "", "choices": ["x", "yz"], "label": 1},
    {
        "instruction": "Question: What cuts paper when there are no scissors around?\n\nAnswer:",
        "choices": ["a knife", "a sponge", "water", "a spoon", "glue"],
        "label": 0,
    },
]


# ---------------------------------------------------------------------------------------------------- fixtures
def build_character_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character, `<s>` prepended, padded with unused tokens to the tiny models' vocabulary size."""
    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: index for index, token in enumerate(specials + list(CHARACTERS))}
    vocab.update({f"<unused_{i}>": i for i in range(len(vocab), VOCAB)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS)])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tokenizer")
    build_character_tokenizer().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_path):
    loaded = AutoTokenizer.from_pretrained(tokenizer_path)
    assert len(loaded) == VOCAB  # the harness would resize the model's embeddings otherwise
    return loaded


def write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def write_task(directory: Path, name: str, data_file: str, **fields) -> str:
    """A task YAML over a local JSONL file (its `test` split); JSON values are valid YAML."""
    config = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": data_file}},
              "test_split": "test", **fields}
    path = directory / f"{name}.yaml"
    path.write_text("".join(f"{key}: {json.dumps(value)}\n" for key, value in config.items()))
    return str(path)


MC_FIELDS = dict(
    output_type="multiple_choice", doc_to_text="instruction", doc_to_choice="choices", doc_to_target="label",
    metric_list=[{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
)


@pytest.fixture(scope="module")
def mc_task_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("mc_task")
    write_task(directory, "local_mc", write_jsonl(directory / "mc.jsonl", MC_DOCS), **MC_FIELDS)
    return directory


def local_tasks(directory: Path) -> TaskManager:
    return TaskManager(include_path=str(directory), include_defaults=False)


# ---------------------------------------------------------------------------------------------------- reference
def harness_encoding(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """How the harness tokenizes a pair for a decoder-only model: the context alone, the continuation as the rest."""
    if context == "":
        return [BOS], tokenizer(continuation, add_special_tokens=False).input_ids
    whole = tokenizer(context + continuation).input_ids
    context_ids = tokenizer(context).input_ids
    return context_ids, whole[len(context_ids) :]


@torch.no_grad()
def training_forward_score(model, context_ids: list[int], continuation_ids: list[int]) -> float:
    """Summed log-probability of the continuation as the answer to the context, from the training forward's loss."""
    input_ids = torch.tensor([context_ids + continuation_ids])
    labels = torch.full_like(input_ids, -100)
    labels[0, len(context_ids) :] = torch.tensor(continuation_ids)
    return -model(input_ids=input_ids, labels=labels).loss.item() * len(continuation_ids)


def reference_multiple_choice(model, tokenizer, docs) -> tuple[list[list[float]], float]:
    """Every choice scored one at a time with the training forward; the accuracy of the argmax."""
    scores = [
        [training_forward_score(model, *harness_encoding(tokenizer, doc["instruction"], " " + choice))
         for choice in doc["choices"]]
        for doc in docs
    ]
    correct = [max(range(len(s)), key=s.__getitem__) == doc["label"] for s, doc in zip(scores, docs)]
    return scores, sum(correct) / len(correct)


def harness_scores(results: dict, task: str) -> list[list[float]]:
    samples = sorted(results["samples"][task], key=lambda sample: sample["doc_id"])
    return [[float(response[0]) for response in sample["filtered_resps"]] for sample in samples]


def assert_scores_close(actual: list[list[float]], expected: list[list[float]]) -> None:
    assert [len(row) for row in actual] == [len(row) for row in expected]
    for actual_row, expected_row in zip(actual, expected):
        assert actual_row == pytest.approx(expected_row, abs=1e-4)


def count_prefilled_rows(monkeypatch, bitune) -> list[int]:
    """Record the batch size of every `prefill` call of this model instance."""
    calls: list[int] = []
    original = bitune.prefill

    def counting_prefill(input_ids, attention_mask=None):
        calls.append(input_ids.shape[0])
        return original(input_ids, attention_mask)

    monkeypatch.setattr(bitune, "prefill", counting_prefill)
    return calls


# ---------------------------------------------------------------------------------------------------- loglikelihood
@pytest.mark.parametrize("arch", ["llama", "gemma2"])  # gemma2: sliding-window layers (window 6) in the cache
def test_multiple_choice_matches_training_forward(arch, load_base, tokenizer, mc_task_dir, monkeypatch):
    model = make_bitune(load_base(arch)).eval()
    expected_scores, expected_accuracy = reference_multiple_choice(model, tokenizer, MC_DOCS)
    prefills = count_prefilled_rows(monkeypatch, model.base_model)

    lm = BituneLM(pretrained=model, tokenizer=tokenizer, batch_size=3)
    results = simple_evaluate(model=lm, tasks=["local_mc"], task_manager=local_tasks(mc_task_dir), log_samples=True)

    assert_scores_close(harness_scores(results, "local_mc"), expected_scores)
    assert results["results"]["local_mc"]["acc,none"] == expected_accuracy
    distinct_contexts = len({doc["instruction"] for doc in MC_DOCS})
    assert sum(prefills) == distinct_contexts  # one prefill per context, whatever its number of choices
    assert max(prefills) > 1  # batched across requests


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
@pytest.mark.parametrize("adapter", [None, "lora"])
def test_prefill_once_scores_plain_models_like_hf(arch, adapter, load_base, tokenizer, mc_task_dir):
    """The base and LoRA models scored with one prefill per context give `hf`'s log-likelihoods and accuracy."""
    model = load_base(arch)
    if adapter == "lora":
        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)).eval()
    tasks = local_tasks(mc_task_dir)
    expected = simple_evaluate(model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=1), tasks=["local_mc"],
                               task_manager=tasks, log_samples=True)
    prefill_calls = []
    lm = PrefillOnceLM(pretrained=model, tokenizer=tokenizer, batch_size=3)
    original = lm._prefill
    lm._prefill = lambda contexts: prefill_calls.append(len(contexts)) or original(contexts)

    results = simple_evaluate(model=lm, tasks=["local_mc"], task_manager=tasks, log_samples=True)

    assert_scores_close(harness_scores(results, "local_mc"), harness_scores(expected, "local_mc"))
    assert results["results"]["local_mc"]["acc,none"] == expected["results"]["local_mc"]["acc,none"]
    assert sum(prefill_calls) == len({doc["instruction"] for doc in MC_DOCS})  # one context read per question


def test_loads_adapter_from_model_args(saved_models, load_base, tokenizer, tokenizer_path, mc_task_dir, tmp_path):
    model = make_bitune(load_base("llama")).eval()
    model.save_pretrained(tmp_path / "adapter")
    expected_scores, expected_accuracy = reference_multiple_choice(model, tokenizer, MC_DOCS)

    results = simple_evaluate(
        model="bitune",
        model_args=f"pretrained={saved_models['llama']},peft={tmp_path / 'adapter'},tokenizer={tokenizer_path},"
        "dtype=float32,device=cpu",
        batch_size=2,
        tasks=["local_mc"],
        task_manager=local_tasks(mc_task_dir),
        log_samples=True,
    )

    assert_scores_close(harness_scores(results, "local_mc"), expected_scores)
    assert results["results"]["local_mc"]["acc,none"] == expected_accuracy


def test_long_context_is_left_truncated_like_hf(load_base, tokenizer, caplog):
    model = make_bitune(load_base("llama")).eval()
    lm = BituneLM(pretrained=model, tokenizer=tokenizer, batch_size=2, max_length=12)
    context, continuation = "Question: a long question here?", " yes"
    context_ids, continuation_ids = harness_encoding(tokenizer, context, continuation)
    kept = context_ids[len(context_ids) + len(continuation_ids) - 1 - 12 :]  # 12 positions: kept[:-1] + answer

    with caplog.at_level(logging.WARNING):
        (score, _), = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])

    assert score == pytest.approx(training_forward_score(model, kept, continuation_ids), abs=1e-4)
    assert "context tokens are dropped" in caplog.text


# ---------------------------------------------------------------------------------------------------- rolling
def test_loglikelihood_rolling_scores_documents_causally_with_the_causal_weights(load_base, tokenizer):
    model = make_bitune(load_base("llama")).eval()
    bitune = model.base_model
    short, long = "a short document.", "a document longer than one window of twelve tokens."
    lm = BituneLM(pretrained=model, tokenizer=tokenizer, batch_size=2, max_length=12)
    rolling_short, rolling_long = lm.loglikelihood_rolling(
        [Instance("loglikelihood_rolling", {}, (text,), 0) for text in (short, long)]
    )

    # One window: the document is the answer to a one-token instruction, exactly the training forward's score.
    long_lm = BituneLM(pretrained=model, tokenizer=tokenizer, batch_size=2, max_length=64)
    (one_window,) = long_lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (short,), 0)])
    assert one_window == pytest.approx(training_forward_score(model, [BOS], tokenizer(short).input_ids), abs=1e-4)

    # Several windows: each is scored on its own, causally, with the causal weights (unbatched, no padding here).
    def causal_windows_score(text):
        total = 0.0
        windows = get_rolling_token_windows(tokenizer(text).input_ids, prefix_token=BOS, max_seq_len=12,
                                            context_len=1)
        for context, continuation in map(make_disjoint_window, windows):
            inputs = torch.tensor([context + continuation[:-1]])
            with torch.no_grad(), bitune.weights("causal"):
                logprobs = torch.log_softmax(bitune.model(input_ids=inputs).logits[0].float(), dim=-1)
            positions = torch.arange(len(context) - 1, inputs.shape[1])
            total += logprobs[positions, torch.tensor(continuation)].sum().item()
        return total

    assert len(tokenizer(long).input_ids) > 2 * 12
    assert rolling_short == pytest.approx(causal_windows_score(short), abs=1e-4)
    assert rolling_long == pytest.approx(causal_windows_score(long), abs=1e-4)


# ---------------------------------------------------------------------------------------------------- generation
def test_generate_until_is_bitune_generation_with_stop_sequences(load_base, tokenizer, tmp_path):
    model = make_bitune(load_base("llama")).eval()
    prompts = ["Question: Name a color.\n\nAnswer:", "Q", "Question: What is two plus two?\n\nAnswer:"]
    max_new_tokens = 6

    def reference_text(prompt):
        tokens = reference_greedy(model, torch.tensor(tokenizer(prompt).input_ids), max_new_tokens)
        if tokenizer.eos_token_id in tokens:
            tokens = tokens[: tokens.index(tokenizer.eos_token_id)]
        return tokenizer.decode(tokens, skip_special_tokens=True)

    full = [reference_text(prompt) for prompt in prompts]
    stop = next(text[2] for text in full if len(text) > 2)  # a stop sequence that cuts a generation short
    expected = [text.split(stop)[0] for text in full]
    assert expected != full

    docs = [{"instruction": prompt, "target": ""} for prompt in prompts]
    write_task(
        tmp_path, "local_generation", write_jsonl(tmp_path / "generation.jsonl", docs),
        output_type="generate_until", doc_to_text="instruction", doc_to_target="target",
        generation_kwargs={"until": [stop], "max_gen_toks": max_new_tokens, "do_sample": False},
        metric_list=[{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
    )
    lm = BituneLM(pretrained=model, tokenizer=tokenizer, batch_size=2)  # batches of 2 and 1, left-padded
    results = simple_evaluate(model=lm, tasks=["local_generation"], task_manager=local_tasks(tmp_path),
                              log_samples=True)

    samples = sorted(results["samples"]["local_generation"], key=lambda sample: sample["doc_id"])
    assert [sample["resps"][0][0] for sample in samples] == expected


# -------------------------------------------------------------------------------------------------- transformers names
def harness_run(lm) -> tuple[list, list]:
    """What `bitune-eval` asks of the model: log-likelihoods (prefill + answer pass) and generations."""
    scores = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(
        [("Question: Which is a fruit?", " apple"), ("Question: Which is a fruit?", " chair"), ("Q", " a")])])
    texts = lm.generate_until([Instance("generate_until", {}, (prompt, {"until": ["\n"], "max_gen_toks": 4,
                                                                      "do_sample": False}), i)
                               for i, prompt in enumerate(["Question: Name a color.\n\nAnswer:", "Q"])])
    return scores, texts


def test_harness_causes_no_deprecation_warnings(load_base, tokenizer):
    lm = BituneLM(pretrained=make_bitune(load_base("llama")).eval(), tokenizer=tokenizer, batch_size=2)
    with renamed_name_warnings() as recorded:
        harness_run(lm)
    assert from_project(recorded) == []


@needs_cache_name
def test_harness_works_once_past_key_values_is_removed(load_base, tokenizer):
    model = make_bitune(load_base("llama")).eval()
    lm = BituneLM(pretrained=model, tokenizer=tokenizer, batch_size=2)
    expected = harness_run(lm)
    with only_cache_argument(model) as replaced:
        assert replaced >= 3
        assert harness_run(lm) == expected


# ---------------------------------------------------------------------------------------------------- refusals
def test_refuses_what_it_cannot_evaluate(saved_models, load_base, tokenizer, tmp_path):
    with pytest.raises(ValueError, match="peft="):
        BituneLM(pretrained="some/base-model")
    with pytest.raises(ValueError, match="batch_size=auto"):
        BituneLM(pretrained="some/base-model", peft="some/adapter", batch_size="auto")
    with pytest.raises(ValueError, match="pretrained` is already a model"):
        BituneLM(pretrained=make_bitune(load_base("llama")), peft="some/adapter", tokenizer=tokenizer)
    lora = get_peft_model(load_base("llama"), LoraConfig(r=2, target_modules="all-linear"))
    with pytest.raises(ValueError, match="Bitune adapter.*LoraModel"):
        BituneLM(pretrained=lora, tokenizer=tokenizer)
    lora.save_pretrained(tmp_path / "lora")
    with pytest.raises(ValueError, match="is a LORA adapter.*`hf` model"):  # refused before the base model loads
        BituneLM(pretrained=saved_models["llama"], peft=str(tmp_path / "lora"), tokenizer=tokenizer)


# ---------------------------------------------------------------------------------------------------- task formats
PAPER_ROWS = {
    "piqa": {"goal": "Open a jar", "sol1": "Twist the lid.", "sol2": "Shake it.", "label": 1},
    "arc_challenge": {"question": "Which is a gas?", "choices": {"text": ["Ice", "Steam", "Rock", "Wood"],
                      "label": ["1", "2", "3", "4"]}, "answerKey": "2"},
    "csqa": {"question": "Where do fish live?", "choices": {"text": ["sea", "tree", "sky", "car", "desk"],
             "label": ["A", "B", "C", "D", "E"]}, "answerKey": "A"},
    "siqa": {"context": "Tom lost his keys.", "question": "How does Tom feel?", "answerA": "happy",
             "answerB": "upset", "answerC": "bored", "label": "2"},
    "mmlu": {"question": " What is 2 + 2? ", "subject": "math", "choices": ["3", "4", "5", "6"], "answer": 1},
    "gsm8k": {"question": "Tom has 3 apples and buys 4. How many?",
              "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
}
EXPECTED = {
    "piqa": ("Question: Open a jar\n\nAnswer:", " Shake it."),
    "arc_challenge": ("Question: Which is a gas?\n\nAnswer:", " Steam"),
    "csqa": ("Question: Where do fish live?\n\nAnswer:", " sea"),
    "siqa": ("Question: Given the context, answer correctly the question.\nContext: Tom lost his keys.\n"
             "Question: How does Tom feel?\n\nChoices:\n(0) happy\n(1) upset\n(2) bored\n\nAnswer:", " (1)"),
    "mmlu": ("Question: What is 2 + 2?\n(0). 3\n(1). 4\n(2). 5\n(3). 6\n\nAnswer:", " (1)"),
    "gsm8k": ("Question: Tom has 3 apples and buys 4. How many?\n\nAnswer:",
              " Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"),
}


@pytest.mark.parametrize("name", sorted(PAPER_TASKS))
def test_paper_format_is_instruction_then_answer_with_a_space(name):
    task = PAPER_TASKS[name]
    pair = task.prompt_completion(PAPER_ROWS[name])
    assert (pair["prompt"], pair["completion"]) == EXPECTED[name]
    assert pair["prompt"].endswith("Answer:") and pair["completion"].startswith(" ")
    assert not pair["completion"].startswith("  ")
    if task.is_multiple_choice:  # the harness scores " " + choice: the training completion is one of them
        assert pair["completion"] in [" " + choice for choice in task.choices(PAPER_ROWS[name])]


def test_format_dataset_gives_trl_prompt_completion_columns():
    import datasets

    rows = datasets.Dataset.from_list([PAPER_ROWS["siqa"], {**PAPER_ROWS["siqa"], "label": "3"}])
    formatted = format_dataset(rows, "siqa")
    assert formatted.column_names == ["prompt", "completion"]
    assert formatted["completion"] == [" (1)", " (2)"]


def test_task_lookup_and_bad_rows():
    assert get_task("bitune_csqa") is get_task("commonsense_qa") is get_task("csqa") is PAPER_TASKS["csqa"]
    with pytest.raises(ValueError, match="Unknown task 'hellaswag'.*piqa"):
        get_task("hellaswag")
    with pytest.raises(ValueError, match="answerKey.*'E'"):
        PAPER_TASKS["arc_challenge"].prompt_completion({**PAPER_ROWS["arc_challenge"], "answerKey": "E"})


@pytest.mark.parametrize("name", sorted(PAPER_TASKS))
def test_harness_task_yaml_agrees_with_the_format(name):
    task = PAPER_TASKS[name]
    config = load_yaml(Path(TASKS_DIR) / f"bitune_{name}.yaml")
    eval_split_key = {"train": "training_split", "validation": "validation_split", "test": "test_split"}
    assert config["task"] == f"bitune_{name}"
    assert (config["dataset_path"], config["dataset_name"]) == (task.dataset_path, task.dataset_name)
    assert config[eval_split_key[task.eval_split]] == task.eval_split
    assert config.get("training_split") == task.train_split
    assert config["process_docs"] == task.process_docs
    assert config["output_type"] == ("multiple_choice" if task.is_multiple_choice else "generate_until")


def test_harness_tasks_score_the_paper_format_end_to_end(load_base, tokenizer, tmp_path):
    """Our bitune_piqa and bitune_gsm8k YAMLs, pointed at local files: contexts, choices and the GSM8K metric."""
    piqa_rows = [PAPER_ROWS["piqa"], {"goal": "Dry hands", "sol1": "Use a towel.", "sol2": "Use water.", "label": 0}]
    gsm8k_rows = [PAPER_ROWS["gsm8k"], {"question": "What is 10 minus 4?", "answer": "10 - 4 = 6\n#### 6"}]
    for name, rows, split in (("piqa", piqa_rows, "validation"), ("gsm8k", gsm8k_rows, "test")):
        data_file = write_jsonl(tmp_path / f"{name}.jsonl", rows)
        overrides = {"task": f"local_{name}", "tag": [], "dataset_path": "json", "dataset_name": None,
                     "training_split": None, "dataset_kwargs": {"data_files": {split: data_file}},
                     "custom_dataset": None}  # the harness's own loading, of the local file
        if name == "gsm8k":
            overrides["generation_kwargs"] = {"until": ["Question:"], "max_gen_toks": 4, "do_sample": False}
        text = f"include: {Path(TASKS_DIR) / f'bitune_{name}.yaml'}\n"
        text += "".join(f"{key}: {json.dumps(value)}\n" for key, value in overrides.items())
        (tmp_path / f"local_{name}.yaml").write_text(text)

    lm = BituneLM(pretrained=make_bitune(load_base("llama")).eval(), tokenizer=tokenizer, batch_size=4)
    results = simple_evaluate(model=lm, tasks=["local_piqa", "local_gsm8k"], task_manager=local_tasks(tmp_path),
                              log_samples=True)

    piqa = get_task("piqa")
    for sample in sorted(results["samples"]["local_piqa"], key=lambda sample: sample["doc_id"]):
        row = piqa_rows[sample["doc_id"]]
        assert [tuple(arguments) for arguments in sample["arguments"]] == [
            (piqa.instruction(row), " " + choice) for choice in piqa.choices(row)
        ]
    generations = [s["resps"][0][0] for s in sorted(results["samples"]["local_gsm8k"], key=lambda s: s["doc_id"])]
    metrics = results["results"]["local_gsm8k"]
    for metric, strict in (("exact_match,none", True), ("exact_match_flexible,none", False)):
        expected = [answers_match(g, row["answer"], strict=strict) for g, row in zip(generations, gsm8k_rows)]
        assert metrics[metric] == sum(expected) / len(expected)


# ---------------------------------------------------------------------------------------------------- answers
@pytest.mark.parametrize(
    ("text", "strict", "flexible"),
    [
        ("#### 72", "72", "72"),
        ("#### 1,234", "1234", "1234"),
        ("#### $1,234.50.", "1234.5", "1234.5"),
        ("#### 72 clips", "72", "72"),
        ("#### 72.", "72", "72"),
        ("#### -3", "-3", "-3"),
        ("#### \u22123", "-3", "-3"),  # Unicode minus
        ("#### -$5", "-5", "-5"),
        ("#### $-5", "-5", "-5"),
        ("#### 0.50", "0.5", "0.5"),
        ("#### .5", "0.5", "0.5"),
        ("#### 1/2", "0.5", "0.5"),
        ("#### 1/3 of a cake", "1/3", "1/3"),
        ("#### 10%", "10", "10"),
        ("#### 1,000,000 people", "1000000", "1000000"),
        ("#### -0", "0", "0"),
        ("Step 1: 2 + 3 = 5.\nStep 2: 5 * 2 = 10.\n#### 10\n\nQuestion: what is 7?", "10", "10"),
        ("First 3-4 = -1.\n#### 8\n#### 9", "8", "8"),  # the first marker is the answer
        ("So she pays $15 per hour, 8 hours: 120 dollars.", None, "120"),
        ("The answer is 3-4 apples", None, "4"),  # a hyphen between numbers is not a minus sign
        ("It costs 1,2345 dollars", None, "2345"),
        ("####", None, None),  # a marker without a number: the format was followed, the answer is missing
        ("no number at all", None, None),
    ],
)
def test_final_answer_extraction_on_tricky_strings(text, strict, flexible):
    assert extract_final_answer(text) == strict
    assert extract_final_answer(text, strict=False) == flexible


def test_numbers_compare_by_value():
    assert normalize_number("3.0") == normalize_number("3") == normalize_number("$3.00.") == "3"
    assert answers_match("so 1,200 in total\n#### $1,200.00", "#### 1200")
    assert answers_match("#### 0.5", "1/2")
    assert not answers_match("#### 12", "#### 1.2")
    assert not answers_match("no answer", "no answer")  # nothing to compare never counts as a match


def test_cot_format_round_trip_and_refusals():
    text = format_cot_answer(["Natalia sold 48 / 2 = 24 clips in May.", "  ", "48 + 24 = 72 in total."], "72")
    assert text == "Natalia sold 48 / 2 = 24 clips in May.\n48 + 24 = 72 in total.\n#### 72"
    parsed = split_cot_answer(" " + text)
    assert parsed.steps == ["Natalia sold 48 / 2 = 24 clips in May.", "48 + 24 = 72 in total."]
    assert parsed.final_answer == "72"
    assert split_cot_answer("just reasoning").final_answer is None
    with pytest.raises(ValueError, match="marker"):
        format_cot_answer(["so #### 5"], "5")
    with pytest.raises(ValueError, match="one non-empty line"):
        format_cot_answer(["step"], "5\n6")


def test_numeric_exact_match_metric_on_evaluate():
    metric = NumericExactMatch()
    scores = metric.compute(
        predictions=["3 + 4 = 7\n#### 7", "It is 7.", "#### 1,000", "#### 5"],
        references=["#### 7", "7", "The total is 1000.\n#### 1000", "6"],
    )
    assert scores == {"exact_match": 0.5, "exact_match_flexible": 0.75}
    with pytest.raises(ValueError, match="empty"):
        metric.compute(predictions=[], references=[])


# ---------------------------------------------------------------------------------------------------- bitune-eval
def test_bitune_eval_adds_the_paper_tasks_unless_told_otherwise():
    run = ["--model", "bitune", "--tasks", "bitune_piqa"]
    assert with_paper_tasks(run) == [*run, "--include_path", TASKS_DIR]
    assert with_paper_tasks(["ls", "tasks"]) == ["ls", "tasks", "--include_path", TASKS_DIR]
    own = [*run, "--include_path", "/my/tasks"]
    assert with_paper_tasks(own) == own
    assert with_paper_tasks([*run, "--include_path=/my/tasks"]) == [*run, "--include_path=/my/tasks"]
    for help_only in ([], ["--help"], ["run"]):
        assert with_paper_tasks(help_only) == help_only


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_bitune_eval_help_without_the_harness_prints_the_help_then_the_install_hint(flag, monkeypatch, capsys):
    """Without the `eval` extra, `bitune-eval --help` exited 1 with the install hint alone; now it prints what the
    command does and its own option, then the hint (and exits 0: the help was asked for and given)."""
    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)  # as if lm-eval were not installed
    with pytest.raises(SystemExit) as error:
        bitune_eval([flag])
    assert error.value.code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith("usage: bitune-eval") and "--data_source" in out and "--model bitune" in out
    assert out.index("--data_source") < out.index("pip install 'peft-bitune[eval]'")
    with pytest.raises(SystemExit, match=r"pip install 'peft-bitune\[eval\]'") as error:  # a run still needs it
        bitune_eval(["--model", "bitune", "--tasks", "bitune_piqa"])


@pytest.mark.slow  # the harness's command line indexes all of its ~15k built-in tasks first
def test_bitune_eval_command_line(saved_models, load_base, tokenizer, tokenizer_path, mc_task_dir, tmp_path):
    model = make_bitune(load_base("llama")).eval()
    model.save_pretrained(tmp_path / "adapter")
    _, expected_accuracy = reference_multiple_choice(model, tokenizer, MC_DOCS)

    bitune_eval([
        "--model", "bitune",
        "--model_args", f"pretrained={saved_models['llama']},peft={tmp_path / 'adapter'},tokenizer={tokenizer_path},"
        "dtype=float32",
        "--tasks", str(mc_task_dir / "local_mc.yaml"),
        "--device", "cpu",
        "--batch_size", "3",
        "--output_path", str(tmp_path / "results"),
    ])

    (results_file,) = (tmp_path / "results").rglob("results_*.json")
    results = json.loads(results_file.read_text())
    assert results["results"]["local_mc"]["acc,none"] == expected_accuracy
    assert results["config"]["model"] == "bitune"


@pytest.mark.parametrize(
    "model_args", ["pretrained={base},peft={adapter}", '{{"pretrained": "{base}", "peft": "{adapter}"}}']
)
def test_bitune_eval_refuses_the_hf_model_on_a_bitune_adapter_before_loading(saved_models, load_base, tmp_path,
                                                                             monkeypatch, model_args):
    """docs/evaluation.md: `bitune-eval --model hf` on a Bitune adapter is refused with the fix, before any loading."""
    make_bitune(load_base("llama")).save_pretrained(tmp_path / "adapter")
    loaded = []
    monkeypatch.setattr(HFLM, "__init__", lambda *args, **kwargs: loaded.append(kwargs))
    arguments = model_args.format(base=saved_models["llama"], adapter=tmp_path / "adapter")
    with pytest.raises(SystemExit, match=r"`--model hf` cannot evaluate the Bitune adapter .* Use `--model bitune`"):
        bitune_eval(["--model", "hf", "--model_args", arguments, "--tasks", "local_mc", "--device", "cpu"])
    assert loaded == []


def test_the_hf_model_given_a_loaded_bitune_adapter_fails_at_its_first_log_likelihood(load_base, tokenizer):
    """docs/evaluation.md: in Python (peft_bitune imported), `HFLM` takes the adapter, then cannot score with it."""
    lm = HFLM(pretrained=make_bitune(load_base("llama")).eval(), tokenizer=tokenizer, batch_size=1)
    request = Instance("loglikelihood", {}, ("a b c", " d"), 0)
    with pytest.raises(ValueError, match="Bitune needs the instruction/answer boundary of every row"):
        lm.loglikelihood([request])


# ---------------------------------------------------------------------------------------------------- seeds example
def load_example():
    path = Path(__file__).parents[1] / "examples" / "evaluate_seeds.py"
    spec = importlib.util.spec_from_file_location("evaluate_seeds", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_seed_summary_and_table():
    example = load_example()
    scores = {"lora": {"piqa": [0.5, 0.7], "gsm8k": [0.1, 0.3]}, "bitune": {"piqa": [0.6, 0.8], "gsm8k": [0.2, 0.2]}}
    summary = example.summarize(scores)
    assert summary["lora"]["piqa"]["mean"] == pytest.approx(0.6)
    assert summary["lora"]["piqa"]["std"] == pytest.approx(0.1414213, abs=1e-6)  # sample std over seeds
    assert summary["lora"]["average"]["values"] == pytest.approx([0.3, 0.5])  # mean over tasks, per seed
    assert summary["bitune"]["average"]["std"] == pytest.approx(0.0707107, abs=1e-6)
    table = example.markdown_table(summary)
    assert table.splitlines()[0] == "| Task | LoRA | Bitune |"
    assert "| piqa | 60.0 ± 14.1 | 70.0 ± 14.1 |" in table
    assert "| **Average** | 40.0 ± 14.1 | 45.0 ± 7.1 |" in table
    single = example.summarize({"lora": {"piqa": [0.5]}})
    assert single["lora"]["piqa"]["std"] is None and example.markdown_table(single).endswith("| 50.0 |")
    with pytest.raises(ValueError, match="number of seeds"):
        example.summarize({"lora": {"piqa": [0.5, 0.6], "gsm8k": [0.1]}})


@pytest.mark.slow  # trains 4 tiny adapters with TRL and evaluates each with the harness
def test_seeds_example_runs_offline(tmp_path, capsys):
    example = load_example()
    output = tmp_path / "results.json"
    example.main(["--smoke", "--tasks", "piqa", "--seeds", "0", "1", "--max_steps", "1", "--max_train_rows", "8",
                  "--eval_limit", "4", "--output", str(output)])
    results = json.loads(output.read_text())
    for method in ("lora", "bitune"):
        values = results["scores"][method]["piqa"]
        assert len(values) == 2 and all(0.0 <= value <= 1.0 for value in values)
        assert results["summary"][method]["average"]["mean"] == pytest.approx(sum(values) / 2)
    assert "| Task | LoRA | Bitune |" in capsys.readouterr().out


@pytest.mark.parametrize("flags", [
    ["--limit", "0"], ["-L", "0"], ["--limit=nan"], ["--limit", "inf"], ["--limit", "1e999"], ["--limit=-3"],
    ["--limit", "2.5"], ["--num_fewshot=-1"], ["--num_fewshot", str(2**64)], ["--max_batch_size", "0"],
    ["--batch_size", "0"], ["--batch_size", "auto:0"], ["--seed", "-1"], ["--seed", f"0,{2**32},1,2"],
])
def test_bitune_eval_refuses_numbers_the_harness_would_fail_on_before_loading_anything(flags, monkeypatch):
    """`--limit 0` ended in the harness's traceback ("did not find any docs") after the model had loaded; now it and
    the other numeric flags that parse but cannot be used are refused in one line, before the harness is imported."""
    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)  # importing the harness would fail the test
    with pytest.raises(SystemExit) as error:
        bitune_eval(["run", "--model", "bitune", "--model_args", "pretrained=x", "--tasks", "local_mc", *flags])
    message = str(error.value.code)
    assert message.startswith("bitune-eval: ") and "`-" in message and "\n" not in message, message


def test_bitune_eval_takes_the_numbers_the_harness_can_use():
    from peft_bitune.evaluation.cli import refuse_unusable_harness_numbers

    for flags in (["--limit", "0.5"], ["-L", "3"], ["--limit=10.0"], ["--num_fewshot", "0"], ["-b", "auto:4"],
                  ["--batch_size", "8"], ["--batch_size=auto"], ["--max_batch_size", "64"], ["--seed", "0,None,1,2"]):
        refuse_unusable_harness_numbers(["run", "--model", "bitune", *flags])  # no SystemExit
