"""Saving, loading and pushing Bitune adapters: checkpoint layout, exact round trips (in a fresh process, also through
an offline Hugging Face cache), several adapters in one model, the model card, and the errors for bad checkpoints."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, RepoUrl
from huggingface_hub.errors import EntryNotFoundError
from peft import AutoPeftModelForCausalLM, IA3Config, LoraConfig, PeftModel
from peft.utils import load_peft_weights
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig

import peft_bitune
from peft_bitune import BituneConfig, BituneModel
from peft_bitune.persistence.hub import push_to_hub
from reference import make_bitune
from tiny_models import COMMON, VOCAB

SAVED_FILES = {"adapter_config.json", "adapter_model.safetensors", "README.md"}
LORA = dict(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
# Each case: architecture, inner adapter config, BituneConfig options.
CASES = {
    "lora": ("llama", LoraConfig(**LORA), {}),
    "dora": ("qwen3", LoraConfig(use_dora=True, **LORA), {}),
    "ia3": (
        "gemma2",
        IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
                  init_ia3_weights=False),
        {},
    ),
    "shared": ("llama", LoraConfig(**LORA), {"shared_weights": True}),
}


def build(load_base, case: str, seed: int = 0):
    arch, adapter_config, options = CASES[case]
    return make_bitune(load_base(arch), adapter_config=adapter_config, seed=seed, **options)


def inner_name(adapter: str, weight_set: str) -> str:
    return peft_bitune.inner_adapter_name(adapter, weight_set)


def batch():
    """Left-padded rows with labels on the answers, and left-padded prompts for generation."""
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, VOCAB, (2, 11), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :3] = 0
    labels = input_ids.clone()
    labels[:, :7] = -100
    labels[attention_mask == 0] = -100
    prompts = input_ids[:, :7].clone()
    prompt_mask = attention_mask[:, :7].clone()
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                prompts=prompts, prompt_mask=prompt_mask)


@torch.no_grad()
def outputs(model, inputs) -> dict[str, torch.Tensor]:
    """Training-forward logits and loss, and greedy generations, in eval mode."""
    model.eval()
    out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=inputs["labels"])
    generated = model.generate(input_ids=inputs["prompts"], attention_mask=inputs["prompt_mask"], max_new_tokens=6,
                               do_sample=False, pad_token_id=0)
    return {"logits": out.logits, "loss": out.loss, "generated": generated}


def assert_identical(got: dict, want: dict, what: str = "") -> None:
    for key in want:
        assert torch.equal(got[key], want[key]), f"{what}{key} differs"


def adapter_tensors(model, adapter: str = "default") -> dict[str, torch.Tensor]:
    """Every parameter of `adapter` in the model (both weight sets and its mixer), keyed by model name."""
    marks = [f".{inner_name(adapter, s)}." for s in ("causal", "bidirectional")]
    return {
        name: param.detach().clone()
        for name, param in model.named_parameters()
        if any(mark in name + "." for mark in marks) or f"bitune_mixers.{adapter}." in name
    }


def to_checkpoint_key(model_key: str, adapter: str = "default") -> str:
    """The documented checkpoint key of a model key: the inner adapter name becomes the weight set name."""
    for weight_set in ("causal", "bidirectional"):
        model_key = model_key.replace(f".{inner_name(adapter, weight_set)}", f".{weight_set}")
    return model_key.replace(f"bitune_mixers.{adapter}.", "bitune_mixers.")


# ------------------------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_holds_both_weight_sets_and_the_mixing_scalars_under_adapter_free_keys(load_base, tmp_path, case):
    model = build(load_base, case)
    model.save_pretrained(tmp_path)

    assert {p.name for p in tmp_path.iterdir()} == SAVED_FILES
    saved = load_file(tmp_path / "adapter_model.safetensors")
    expected = {to_checkpoint_key(name): value for name, value in adapter_tensors(model).items()}
    assert saved.keys() == expected.keys()
    for key in expected:
        assert torch.equal(saved[key], expected[key]), key
    assert "base_model.bitune_mixers.key_weights" in saved and "base_model.bitune_mixers.value_weights" in saved
    assert not any("default" in key for key in saved)
    layer = "base_model.model.model.layers.0"
    documented_key = {
        "lora": f"{layer}.self_attn.q_proj.lora_A.{{}}.weight",
        "shared": f"{layer}.self_attn.q_proj.lora_A.{{}}.weight",
        "dora": f"{layer}.self_attn.q_proj.lora_magnitude_vector.{{}}.weight",
        "ia3": f"{layer}.mlp.down_proj.ia3_l.{{}}",
    }[case]
    assert documented_key.format("causal") in saved
    if case == "shared":
        assert not any(".bidirectional" in key for key in saved)
    else:
        assert documented_key.format("bidirectional") in saved

    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["peft_type"] == "BITUNE"
    assert config["adapter_config"]["peft_type"] == ("IA3" if case == "ia3" else "LORA")
    bitune_config = model.peft_config["default"]
    for field in ("mix_init", "mix_scale", "shared_weights", "second_pass_attention", "train_mixing", "task_type"):
        assert config[field] == getattr(bitune_config, field), field
    assert config["base_model_name_or_path"] == model.get_base_model().name_or_path


# ------------------------------------------------------------------------------------------- fresh process and Hub
WORKER = textwrap.dedent(
    """
    import json, sys, traceback
    import torch
    from peft import AutoPeftModelForCausalLM, PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    spec = json.load(open(sys.argv[1]))
    torch.set_num_threads(spec["threads"])  # as in the test process, so that both compute the same way
    report = {"plugin_imported_before": "peft_bitune" in sys.modules, "without_plugin": {}}
    # 1. Loading a Bitune adapter without `import peft_bitune`: the error a user sees.
    for how in ("PeftModel", "AutoPeftModelForCausalLM"):
        try:
            if how == "PeftModel":
                base = AutoModelForCausalLM.from_pretrained(spec["plain_base"])
                PeftModel.from_pretrained(base, spec["plain_adapter"])
            else:
                AutoPeftModelForCausalLM.from_pretrained(spec["plain_adapter"])
            report["without_plugin"][how] = None
        except Exception as error:
            report["without_plugin"][how] = [type(error).__name__, str(error),
                                             traceback.format_exception_only(error)[-1].strip()]

    # 2. With the plugin: every job loads an adapter and records its outputs.
    import peft_bitune
    inputs = load_file(spec["inputs"])
    results, states = {}, {}
    for job in spec["jobs"]:
        if job["loader"] == "auto":
            model = AutoPeftModelForCausalLM.from_pretrained(job["adapter"], **job["kwargs"])
            model.get_base_model().set_attn_implementation("eager")
        else:
            base = AutoModelForCausalLM.from_pretrained(job["base"], attn_implementation="eager", dtype=torch.float32)
            model = PeftModel.from_pretrained(base, job["adapter"], **job["kwargs"])
        model.eval()
        with torch.no_grad():
            out = model(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=inputs["labels"]
            )
            generated = model.generate(input_ids=inputs["prompts"], attention_mask=inputs["prompt_mask"],
                                       max_new_tokens=6, do_sample=False, pad_token_id=0)
        results[job["name"] + ".logits"] = out.logits.contiguous()
        results[job["name"] + ".loss"] = out.loss.reshape(1)
        results[job["name"] + ".generated"] = generated.contiguous()
        states[job["name"]] = {
            "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
            "base_model_name_or_path": model.peft_config["default"].base_model_name_or_path,
        }
    save_file(results, spec["outputs"])
    report["states"] = states
    json.dump(report, open(spec["report"], "w"))
    """
)


def write_hub_snapshot(cache: Path, repo_id: str, folder: Path, commit: str, refs: tuple[str, ...] = ()) -> None:
    """Put `folder` into an HF cache the way huggingface_hub lays it out: blobs, a snapshot of links, refs."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(folder.iterdir()):
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / file.name)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)


def commit_hash(label: str) -> str:
    return hashlib.sha1(label.encode()).hexdigest()


@pytest.fixture(scope="module")
def fresh_process(load_base, saved_models, tmp_path_factory):
    """
    Save adapters here, then load them in a new Python process (local folders, an offline HF cache, AutoPeftModel)
    and return what that process computed next to what this one computed before saving.
    """
    root = tmp_path_factory.mktemp("persistence")
    inputs = batch()
    save_file(inputs, root / "inputs.safetensors")
    expected, jobs = {}, []
    for case in CASES:
        model = build(load_base, case)
        expected[case] = outputs(model, inputs)
        model.save_pretrained(root / case)
        jobs.append({"name": case, "loader": "peft", "adapter": str(root / case),
                     "base": saved_models[CASES[case][0]], "kwargs": {}})
    jobs.append({"name": "auto_local", "loader": "auto", "adapter": str(root / "lora"), "kwargs": {}})

    # The Hub: the base model and two revisions of an adapter repo, in a cache that is only read offline.
    cache = root / "hf_cache"
    write_hub_snapshot(cache, "tiny/llama-base", Path(saved_models["llama"]), commit_hash("base"), refs=("main",))
    hub_adapter = root / "hub_lora"
    shutil.copytree(root / "lora", hub_adapter)
    config = json.loads((hub_adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "tiny/llama-base"
    (hub_adapter / "adapter_config.json").write_text(json.dumps(config))
    write_hub_snapshot(cache, "user/bitune-tiny", hub_adapter, commit_hash("v1"), refs=("main",))
    other = build(load_base, "lora", seed=1)
    expected["v2"] = outputs(other, inputs)
    other.save_pretrained(root / "v2")
    write_hub_snapshot(cache, "user/bitune-tiny", root / "v2", commit_hash("v2"), refs=("v2",))
    llama = saved_models["llama"]
    jobs += [
        {"name": "hub_main", "loader": "peft", "adapter": "user/bitune-tiny", "base": llama, "kwargs": {}},
        {"name": "hub_branch", "loader": "peft", "adapter": "user/bitune-tiny", "base": llama,
         "kwargs": {"revision": "v2"}},
        {"name": "hub_commit", "loader": "peft", "adapter": "user/bitune-tiny", "base": llama,
         "kwargs": {"revision": commit_hash("v1")}},
        {"name": "hub_auto", "loader": "auto", "adapter": "user/bitune-tiny", "kwargs": {}},
    ]
    spec = {"jobs": jobs, "inputs": str(root / "inputs.safetensors"), "outputs": str(root / "outputs.safetensors"),
            "report": str(root / "report.json"), "threads": torch.get_num_threads(),
            "plain_base": llama, "plain_adapter": str(root / "lora")}
    (root / "spec.json").write_text(json.dumps(spec))
    (root / "worker.py").write_text(WORKER)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "HF_HOME": str(root / "hf_home"),
           "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
    env.pop("HF_TOKEN", None)
    done = subprocess.run([sys.executable, str(root / "worker.py"), str(root / "spec.json")], env=env, cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    got = load_file(root / "outputs.safetensors")
    report = json.loads((root / "report.json").read_text())
    loaded = {job["name"]: {key: got[f"{job['name']}.{key}"] for key in ("logits", "loss", "generated")}
              for job in jobs}
    return expected, loaded, report


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_fresh_process_reproduces_logits_and_greedy_generation_bit_for_bit(fresh_process, case):
    expected, loaded, report = fresh_process
    want = {**expected[case], "loss": expected[case]["loss"].reshape(1)}
    assert_identical(loaded[case], want, f"{case}: ")
    assert report["states"][case]["trainable"] == [], "is_trainable=False must freeze every adapter parameter"


@pytest.mark.slow
def test_auto_peft_model_loads_the_base_model_recorded_in_the_adapter_config(fresh_process, saved_models):
    expected, loaded, report = fresh_process
    want = {**expected["lora"], "loss": expected["lora"]["loss"].reshape(1)}
    assert report["states"]["auto_local"]["base_model_name_or_path"] == saved_models["llama"]
    assert_identical(loaded["auto_local"], want)


@pytest.mark.slow
@pytest.mark.parametrize(("job", "source"), [("hub_main", "lora"), ("hub_branch", "v2"), ("hub_commit", "lora"),
                                             ("hub_auto", "lora")])
def test_loading_by_repo_id_from_an_offline_hub_cache_honours_the_revision(fresh_process, job, source):
    expected, loaded, _ = fresh_process
    assert not torch.equal(expected["lora"]["logits"], expected["v2"]["logits"])  # the revisions are distinguishable
    want = {**expected[source], "loss": expected[source]["loss"].reshape(1)}
    assert_identical(loaded[job], want, f"{job}: ")


@pytest.mark.slow
def test_without_import_peft_bitune_peft_fails_with_a_key_error_naming_the_type(fresh_process):
    _, _, report = fresh_process
    assert report["plugin_imported_before"] is False
    for how in ("PeftModel", "AutoPeftModelForCausalLM"):
        name, message, line = report["without_plugin"][how]
        assert (name, message, line) == ("KeyError", "'BITUNE'", "KeyError: 'BITUNE'"), how


# ------------------------------------------------------------------------------------------------------- training
def train_steps(model, steps: int, seed: int = 5) -> None:
    """A few SGD steps on fixed random batches (SGD has no state, so a fresh optimizer continues exactly)."""
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for step in range(steps):
        inputs = batch() if step % 2 == 0 else {**batch(), "input_ids": batch()["input_ids"].flip(1)}
        loss = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                     labels=inputs["labels"]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def trainable(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}


def test_is_trainable_true_continues_training_exactly_as_if_never_saved(load_base, tmp_path):
    model = build(load_base, "lora")
    train_steps(model, 2)
    model.save_pretrained(tmp_path)
    before = trainable(model)
    train_steps(model, 2)

    loaded = PeftModel.from_pretrained(load_base("llama"), tmp_path, is_trainable=True)
    assert trainable(loaded).keys() == before.keys()
    assert any("bitune_mixers" in name for name in before) and any("__bidirectional" in name for name in before)
    for name, value in trainable(loaded).items():
        assert torch.equal(value, before[name]), name
    train_steps(loaded, 2)
    continued, reference = trainable(loaded), trainable(model)
    for name in reference:
        assert torch.equal(continued[name], reference[name]), name


def test_is_trainable_false_freezes_both_weight_sets_and_the_mixing_scalars(load_base, tmp_path):
    build(load_base, "lora").save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(load_base("llama"), tmp_path)
    assert not any(param.requires_grad for param in loaded.parameters())
    assert not loaded.training


def test_frozen_mixing_stays_frozen_after_loading_for_training(load_base, tmp_path):
    make_bitune(load_base("llama"), adapter_config=LoraConfig(**LORA), train_mixing=False).save_pretrained(tmp_path)
    loaded = PeftModel.from_pretrained(load_base("llama"), tmp_path, is_trainable=True)
    names = trainable(loaded).keys()
    assert names and not any("bitune_mixers" in name for name in names)


def test_load_adapter_into_the_same_adapter_restores_a_checkpoint(load_base, tmp_path):
    """What `Trainer(resume_from_checkpoint=...)` does: load the weights into the existing, trainable adapter."""
    saved = build(load_base, "lora")
    saved.save_pretrained(tmp_path)
    model = build(load_base, "lora", seed=7)
    model.load_adapter(tmp_path, adapter_name="default", is_trainable=True)
    want = adapter_tensors(saved)
    for name, value in adapter_tensors(model).items():
        assert torch.equal(value, want[name]), name
    assert trainable(model).keys() == want.keys()


# ----------------------------------------------------------------------------------------------- several adapters
def test_several_bitune_adapters_load_switch_and_save_separately(load_base, tmp_path):
    inputs = batch()
    first, second = build(load_base, "lora", seed=0), build(load_base, "lora", seed=1)
    want_first, want_second = outputs(first, inputs), outputs(second, inputs)
    first.save_pretrained(tmp_path / "first")
    second.save_pretrained(tmp_path / "second")

    model = PeftModel.from_pretrained(load_base("llama"), tmp_path / "first")
    model.load_adapter(tmp_path / "second", adapter_name="task2")
    assert_identical(outputs(model, inputs), want_first, "default: ")
    model.set_adapter("task2")
    assert_identical(outputs(model, inputs), want_second, "task2: ")
    model.set_adapter("default")
    assert_identical(outputs(model, inputs), want_first, "default again: ")

    # Saving writes each adapter on its own (PEFT's filter of other adapters does not see inner names).
    model.save_pretrained(tmp_path / "both")
    for folder, source in (
        (tmp_path / "both", tmp_path / "first"),
        (tmp_path / "both" / "task2", tmp_path / "second"),
    ):
        saved = load_file(folder / "adapter_model.safetensors")
        original = load_file(source / "adapter_model.safetensors")
        assert saved.keys() == original.keys()
        assert all(torch.equal(saved[key], original[key]) for key in saved)


def test_an_adapter_loaded_for_training_trains_once_active(load_base, tmp_path):
    build(load_base, "lora", seed=1).save_pretrained(tmp_path)
    model = build(load_base, "lora")
    model.load_adapter(tmp_path, adapter_name="task2", is_trainable=True)
    # Like PEFT, `is_trainable=True` marks the loaded adapter trainable at once: both weight sets and the mixing.
    for part in ("task2__causal", "task2__bidirectional", "bitune_mixers.task2"):
        assert any(part in name for name in trainable(model)), part
    model.set_adapter("task2")
    names = list(trainable(model))
    assert all("task2" in name for name in names)
    for part in ("task2__causal", "task2__bidirectional", "bitune_mixers.task2"):
        assert any(part in name for name in names), part


# ----------------------------------------------------------------------------------------------------- model card
def test_model_card_says_bitune_and_shows_how_to_load_it(load_base, tmp_path):
    model = build(load_base, "lora")
    model.peft_config["default"].base_model_name_or_path = "tiny/llama-base"  # as if loaded from the Hub
    model.save_pretrained(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    assert {"bitune", "peft", "base_model:adapter:tiny/llama-base"} <= set(card.data.tags)
    assert card.data.base_model == "tiny/llama-base" and card.data.library_name == "peft"
    assert "import peft, peft_bitune" in card.text
    assert f'model = peft.AutoPeftModelForCausalLM.from_pretrained("{tmp_path}")' in card.text

    # Saving again updates the section in place and keeps what the user wrote.
    card.text += "\n## My notes\nTrained on my data.\n"
    card.save(tmp_path / "README.md")
    model.save_pretrained(tmp_path)
    text = (tmp_path / "README.md").read_text()
    assert text.count("## Bitune adapter") == 1 and "Trained on my data." in text


def test_model_card_names_a_local_base_model_only_in_its_text(load_base, saved_models, tmp_path):
    """The Hub accepts only repo ids as `base_model`: PEFT's local path there would make an upload fail."""
    build(load_base, "lora").save_pretrained(tmp_path)
    card = ModelCard.load(tmp_path / "README.md")
    assert card.data.base_model is None
    assert {"bitune", "peft"} <= set(card.data.tags)
    assert not any(tag.startswith("base_model:adapter:") for tag in card.data.tags)
    assert saved_models["llama"] in card.text


def test_model_card_of_the_shown_loading_lines_loads_the_adapter(load_base, saved_models, tmp_path):
    """The lines the card shows are real code: run them."""
    build(load_base, "lora").save_pretrained(tmp_path)
    text = ModelCard.load(tmp_path / "README.md").text
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(code, scope)  # noqa: S102 - the card's own two lines
    assert type(scope["model"].base_model).__name__ == "BituneModel"


# ------------------------------------------------------------------------------------------------------------- Hub
class RecordingHubApi(HfApi):
    """huggingface_hub's client with every call that would reach the Hub replaced by a record of it."""

    def __init__(self):
        super().__init__(token="hf_test")
        self.calls: list[tuple[str, dict]] = []
        self.uploaded: dict[str, bytes] = {}

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", {"repo_id": repo_id, **kwargs}))
        return RepoUrl(f"https://huggingface.co/{repo_id}")

    def create_branch(self, repo_id, **kwargs):
        self.calls.append(("create_branch", {"repo_id": repo_id, **kwargs}))

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        """The upload call of `peft_bitune.push_to_hub`: records every file of the folder as it is at upload time."""
        self.calls.append(("upload_folder", {"repo_id": repo_id, **kwargs}))
        self.uploaded = saved_bytes(Path(folder_path))
        return "commit-info"

    def create_commit(self, repo_id, operations, **kwargs):
        """The upload call of transformers' `push_to_hub`."""
        self.calls.append(("create_commit", {"repo_id": repo_id, **kwargs}))
        for operation in operations:
            assert isinstance(operation, CommitOperationAdd)
            self.uploaded[operation.path_in_repo] = Path(operation.path_or_fileobj).read_bytes()
        return "commit-info"


def saved_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_push_to_hub_uploads_exactly_what_save_pretrained_writes(load_base, tmp_path):
    model = build(load_base, "lora")
    model.save_pretrained(tmp_path)
    api = RecordingHubApi()

    result = push_to_hub(model, "user/bitune-tiny", private=True, commit_message="Bitune r=4", api=api)

    assert result == "commit-info"
    local = saved_bytes(tmp_path)
    assert set(api.uploaded) == set(local) == SAVED_FILES
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert api.uploaded[name] == local[name], name
    # The card differs only in where it says to load from.
    assert api.uploaded["README.md"].decode() == local["README.md"].decode().replace(str(tmp_path), "user/bitune-tiny")
    calls = dict(api.calls)
    assert calls["create_repo"]["private"] is True and calls["create_repo"]["exist_ok"] is True
    assert calls["upload_folder"]["commit_message"] == "Bitune r=4"
    assert "create_branch" not in calls


def test_push_to_hub_pushes_every_adapter_and_creates_the_branch(load_base, tmp_path):
    model = build(load_base, "lora")
    model.add_adapter("task2", BituneConfig(adapter_config=LoraConfig(**LORA)))
    model.save_pretrained(tmp_path)
    api = RecordingHubApi()
    push_to_hub(model, "user/bitune-tiny", revision="v2", api=api)
    assert set(api.uploaded) == set(saved_bytes(tmp_path))
    assert "task2/adapter_model.safetensors" in api.uploaded
    assert 'subfolder="task2"' in api.uploaded["task2/README.md"].decode()
    calls = dict(api.calls)
    assert calls["create_branch"]["branch"] == "v2" and calls["upload_folder"]["revision"] == "v2"


def test_stock_push_to_hub_uploads_the_adapter_but_replaces_the_card(load_base, tmp_path, monkeypatch):
    """`model.push_to_hub` is transformers' PushToHubMixin: same adapter files, but README.md is the Hub's card."""
    import transformers.utils.hub as transformers_hub

    load_card = ModelCard.load

    def no_card_on_the_hub_yet(repo_id_or_path, **kwargs):
        if not os.path.exists(repo_id_or_path):
            raise EntryNotFoundError("no README.md in the repo yet")
        return load_card(repo_id_or_path, **kwargs)

    api = RecordingHubApi()
    monkeypatch.setattr(transformers_hub, "hf_api", lambda: api)
    monkeypatch.setattr(ModelCard, "load", no_card_on_the_hub_yet)
    model = build(load_base, "lora")
    model.save_pretrained(tmp_path)

    model.push_to_hub("user/bitune-tiny", private=True, commit_message="Bitune r=4")

    local = saved_bytes(tmp_path)
    assert set(api.uploaded) == set(local)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert api.uploaded[name] == local[name], name
    calls = dict(api.calls)
    assert calls["create_repo"]["private"] is True and calls["create_commit"]["commit_message"] == "Bitune r=4"
    assert b"peft_bitune" not in api.uploaded["README.md"]  # why `peft_bitune.push_to_hub` exists


# ---------------------------------------------------------------------------------------------------------- errors
def other_llama(**changes):
    torch.manual_seed(0)
    config = LlamaConfig(**{**COMMON, "num_key_value_heads": 2, **changes})
    return AutoModelForCausalLM.from_config(config).eval()


def forget_recorded_base_shape(folder: Path) -> None:
    """Make a saved adapter look like one saved before the base model's shape was recorded."""
    path = folder / "adapter_config.json"
    config = json.loads(path.read_text())
    del config["base_model_vocab_size"], config["base_model_num_hidden_layers"]
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": 48}, "does not fit this base model"),
        ({"num_hidden_layers": 1}, "has no place for"),
        ({"num_hidden_layers": 3}, "is incomplete"),
    ],
)
def test_a_different_base_model_is_refused_also_for_adapters_without_recorded_shape(
    load_base, tmp_path, changes, message
):
    build(load_base, "lora").save_pretrained(tmp_path)
    forget_recorded_base_shape(tmp_path)
    with pytest.raises(ValueError, match=message) as error:
        PeftModel.from_pretrained(other_llama(**changes), tmp_path)
    assert "base model" in str(error.value)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"vocab_size": 4096}, "a vocabulary of 96 tokens \\(this base model has 4096\\)"),
        ({"num_hidden_layers": 3}, "2 decoder layers \\(this base model has 3\\)"),
        ({"num_hidden_layers": 1}, "2 decoder layers \\(this base model has 1\\)"),
    ],
)
def test_a_base_model_of_another_recorded_shape_is_refused_before_any_weight_is_made(
    load_base, saved_models, tmp_path, changes, message
):
    model = build(load_base, "lora")
    assert model.peft_config["default"].base_model_vocab_size == VOCAB
    assert model.peft_config["default"].base_model_num_hidden_layers == 2
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (saved["base_model_vocab_size"], saved["base_model_num_hidden_layers"]) == (VOCAB, 2)
    other = other_llama(**changes)
    with pytest.raises(ValueError, match=message) as error:
        PeftModel.from_pretrained(other, tmp_path)
    assert saved_models["llama"] in str(error.value)  # the recorded base, to load the adapter onto
    assert not any("lora_" in name for name, _ in other.named_parameters())
    # The same check guards a second adapter loaded into a model of another base.
    target = make_bitune(other)
    with pytest.raises(ValueError, match=message):
        target.load_adapter(tmp_path, adapter_name="task2")
    assert set(target.peft_config) == {"default"}


def test_an_adapter_on_a_base_model_of_another_name_warns_with_both_names(load_base, saved_models, tmp_path):
    build(load_base, "lora").save_pretrained(tmp_path)
    other_path = tmp_path / "other-llama"
    other_llama().save_pretrained(other_path)  # the same shape, other weights: PEFT loads it without a word
    with pytest.warns(UserWarning, match="made on the base model '.*/llama', and is being used with '.*/other-llama'"):
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(other_path), tmp_path)
    # Another spelling of the recorded base (a relative path to the same folder) is the same model: no warning.
    relative = os.path.relpath(saved_models["llama"])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(relative), tmp_path)


def test_an_adapter_saved_before_the_base_shape_was_recorded_still_loads_and_records_it(load_base, tmp_path):
    model = build(load_base, "lora")
    model.save_pretrained(tmp_path)
    forget_recorded_base_shape(tmp_path)
    loaded = PeftModel.from_pretrained(load_base("llama"), tmp_path)
    ids = torch.randint(3, VOCAB, (1, 9))
    labels = ids.clone()
    labels[:, :5] = -100
    torch.testing.assert_close(loaded(input_ids=ids, labels=labels).logits, model(input_ids=ids, labels=labels).logits)
    config = loaded.peft_config["default"]
    assert (config.base_model_vocab_size, config.base_model_num_hidden_layers) == (VOCAB, 2)


def test_config_values_of_the_wrong_type_in_adapter_config_json_are_refused_by_name(load_base, tmp_path):
    build(load_base, "lora").save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    config = json.loads(path.read_text())
    for change, message in [
        ({"train_mixing": "no"}, "`train_mixing` must be true or false, got 'no'"),
        ({"inference_mode": "yes"}, "`inference_mode` must be true or false, got 'yes'"),
        ({"mix_scale": float("inf")}, "`mix_scale` must be a finite number, got inf"),
        ({"mix_init": "abc"}, "`mix_init` must be a finite number, got 'abc'"),
        ({"adapter_config": {**config["adapter_config"], "r": "8"}}, "`adapter_config.r` must be a finite number"),
    ]:
        path.write_text(json.dumps({**config, **change}))  # json writes inf as Infinity
        with pytest.raises(ValueError, match=message):
            PeftModel.from_pretrained(load_base("llama"), tmp_path)


def edit_checkpoint(folder: Path, drop) -> None:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    save_file({key: value for key, value in tensors.items() if not drop(key)}, path)


@pytest.mark.parametrize(
    ("drop", "message"),
    [
        (lambda key: "bitune_mixers" in key, "lacks the mixing scalars"),
        (lambda key: ".bidirectional." in key, "lacks weights of the bidirectional set"),
        (lambda key: ".causal." in key, "lacks weights of the causal set"),
        (lambda key: key.endswith("layers.1.mlp.up_proj.lora_B.causal.weight"), "lacks weights of the causal set"),
    ],
    ids=["mixers", "bidirectional", "causal", "one-tensor"],
)
def test_an_incomplete_checkpoint_is_refused_before_anything_is_loaded(load_base, tmp_path, drop, message):
    build(load_base, "lora").save_pretrained(tmp_path)
    edit_checkpoint(tmp_path, drop)
    with pytest.raises(ValueError, match=message):
        PeftModel.from_pretrained(load_base("llama"), tmp_path)

    model = build(load_base, "lora", seed=4)
    before = adapter_tensors(model)
    with pytest.raises(ValueError, match=message):
        model.load_adapter(tmp_path, adapter_name="default")
    for name, value in adapter_tensors(model).items():
        assert torch.equal(value, before[name]), name
    # A refused new adapter leaves nothing behind (PEFT adds it before reading the file).
    with pytest.raises(ValueError, match=message):
        model.load_adapter(tmp_path, adapter_name="task2")
    assert set(model.peft_config) == {"default"}
    assert not any("task2" in name for name, _ in model.named_parameters())


@pytest.mark.parametrize(
    ("key_part", "bad"),
    [("bitune_mixers.key_weights", float("nan")), ("layers.1.self_attn.v_proj.lora_B.bidirectional", float("inf"))],
    ids=["nan-mixing-scalar", "inf-weight"],
)
def test_non_finite_weights_are_refused_naming_the_first_bad_key(load_base, tmp_path, key_part, bad):
    build(load_base, "lora").save_pretrained(tmp_path)
    path = tmp_path / "adapter_model.safetensors"
    tensors = load_file(path)
    (key,) = [key for key in tensors if key_part in key]
    tensors[key] = tensors[key].clone()
    tensors[key].view(-1)[1] = bad  # what a flipped exponent byte decodes to
    save_file(tensors, path)
    message = f"non-finite values \\(NaN or infinity\\): `{re.escape(key)}` has 1 of them"
    with pytest.raises(ValueError, match=message):
        PeftModel.from_pretrained(load_base("llama"), tmp_path)
    model = build(load_base, "lora", seed=4)
    before = adapter_tensors(model)
    for name in ("default", "task2"):
        with pytest.raises(ValueError, match=message):
            model.load_adapter(tmp_path, adapter_name=name)
    assert set(model.peft_config) == {"default"}
    for name, value in adapter_tensors(model).items():
        assert torch.equal(value, before[name]), name


def test_an_unknown_config_field_is_refused_with_the_upgrade_hint(load_base, tmp_path):
    build(load_base, "lora").save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "future_option": True}))
    with pytest.raises(ValueError, match=r"\['future_option'\].*pip install -U peft-bitune"):
        PeftModel.from_pretrained(load_base("llama"), tmp_path)
    with pytest.raises(ValueError, match=r"\['future_option'\]"):
        AutoPeftModelForCausalLM.from_pretrained(tmp_path)



def test_an_unknown_inner_config_field_is_dropped_with_peft_s_warning(load_base, tmp_path):
    """PEFT's rule for its own configs: a field of the inner method's config written by a newer PEFT is dropped with a
    warning, so that the adapter loads (and runs as saved) in an older PEFT."""
    model = build(load_base, "lora")
    model.save_pretrained(tmp_path)
    path = tmp_path / "adapter_config.json"
    config = json.loads(path.read_text())
    config["adapter_config"]["future_lora_option"] = 1
    path.write_text(json.dumps(config))
    with pytest.warns(UserWarning, match=r"\['future_lora_option'\] for class LoraConfig .*pip install -U peft`"):
        loaded = PeftModel.from_pretrained(load_base("llama"), tmp_path)
    assert not hasattr(loaded.peft_config["default"].adapter_config, "future_lora_option")
    inputs = batch()
    assert_identical(outputs(loaded, inputs), outputs(model.eval(), inputs))


# ---------------------------------------------------------------------------------------------------- pickled weights
def pickle_and_safetensors_saves(model, tmp_path: Path) -> tuple[Path, Path]:
    model.save_pretrained(tmp_path / "safe")
    model.save_pretrained(tmp_path / "pickled", safe_serialization=False)
    return tmp_path / "safe", tmp_path / "pickled"


def test_a_pickled_save_is_written_as_peft_writes_it_and_loads_back_exactly(load_base, tmp_path):
    """`safe_serialization=False` is PEFT's own save (see weights_files.py): the same checkpoint, as a pickle, which
    loads back with both weight sets and the mixing scalars exactly, under any adapter name."""
    model = build(load_base, "lora")
    safe, pickled = pickle_and_safetensors_saves(model, tmp_path)
    assert sorted(os.listdir(pickled)) == ["README.md", "adapter_config.json", "adapter_model.bin"]
    written = torch.load(pickled / "adapter_model.bin", weights_only=True)
    expected = load_file(safe / "adapter_model.safetensors")
    assert written.keys() == expected.keys() and all(torch.equal(written[key], expected[key]) for key in expected)

    want = adapter_tensors(model)
    assert any(".default__bidirectional." in name for name in want)
    assert {"base_model.bitune_mixers.default.key_weights", "base_model.bitune_mixers.default.value_weights"} <= set(
        want
    )
    loaded = PeftModel.from_pretrained(load_base("llama"), pickled)
    got = adapter_tensors(loaded)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)
    inputs = batch()
    assert_identical(outputs(loaded, inputs), outputs(model, inputs))

    loaded.load_adapter(str(pickled), adapter_name="second")
    second = {to_checkpoint_key(name, "second"): value for name, value in adapter_tensors(loaded, "second").items()}
    assert second.keys() == expected.keys()
    assert all(torch.equal(second[key], expected[key]) for key in expected)


def test_a_folder_with_both_weights_files_warns_that_the_pickle_is_ignored(load_base, tmp_path):
    model = build(load_base, "lora")
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="holds both adapter_model.safetensors and adapter_model.bin.*reads "
                                         "adapter_model.safetensors and ignores adapter_model.bin"):
        model.save_pretrained(tmp_path, safe_serialization=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        model.save_pretrained(tmp_path / "alone", safe_serialization=False)


class RunsCode:
    """Unpickling this runs `code`, as a malicious `adapter_model.bin` would."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return exec, (self.code,)


UNSAFE_WRITERS = {"torch.save": torch.save, "pickle.dump": lambda obj, path: path.write_bytes(pickle.dumps(obj))}
UNSAFE_READERS = {  # reading without `weights_only`: runs the payload, so that the test would see it run
    "torch.save": lambda path: torch.load(path, weights_only=False),
    "pickle.dump": lambda path: pickle.loads(path.read_bytes()),
}


@pytest.mark.parametrize("writer", list(UNSAFE_WRITERS))
def test_an_unsafe_pickle_is_refused_on_loading_and_never_run(load_base, tmp_path, writer):
    model = build(load_base, "lora")
    _, folder = pickle_and_safetensors_saves(model, tmp_path)
    path, marker = folder / "adapter_model.bin", tmp_path / "payload-ran"
    weights = torch.load(path, weights_only=True)
    UNSAFE_WRITERS[writer]({**weights, "payload": RunsCode(f"open({str(marker)!r}, 'w').write('ran')")}, path)

    # PEFT's own loader reads it with torch.load(weights_only=True), which refuses it without running it ...
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        load_peft_weights(str(folder))
    assert not marker.exists()
    # ... but only after PEFT has added the adapter: the check on loading refuses it before.
    base = load_base("llama")
    names = [name for name, _ in base.named_modules()]
    refused = rf"'{re.escape(str(path))}' is refused by `torch.load\(weights_only=True\)`.*Nothing was loaded"
    with pytest.raises(ValueError, match=refused) as error:
        PeftModel.from_pretrained(base, folder)
    assert "safe_globals" not in str(error.value) and "weights_only=False" not in str(error.value)  # torch's advice
    assert [name for name, _ in base.named_modules()] == names
    keys = set(model.state_dict())
    with pytest.raises(ValueError, match=refused):
        model.load_adapter(str(folder), adapter_name="second")
    assert list(model.peft_config) == ["default"] and set(model.state_dict()) == keys
    assert not marker.exists()

    assert UNSAFE_READERS[writer](path)["payload"] is None  # what `exec` returned, after it ran the payload
    assert marker.read_text() == "ran"


@pytest.mark.parametrize("damage", ["unsafe_pickle", "truncated_safetensors"])
def test_damaged_weights_in_the_hub_cache_are_refused_before_peft_adds_the_adapter(load_base, tmp_path, monkeypatch,
                                                                                    damage):
    """From a Hub repo, the weights file PEFT will read is fetched into the cache first (offline: read from it) and
    checked as a local one is: an unsafe pickle or a damaged file is refused, unrun, and the model gains nothing."""
    import huggingface_hub

    model = build(load_base, "lora")
    safe, pickled = pickle_and_safetensors_saves(model, tmp_path)
    marker = tmp_path / "payload-ran"
    if damage == "unsafe_pickle":
        folder, weights = pickled, pickled / "adapter_model.bin"
        payload = RunsCode(f"open({str(marker)!r}, 'w').write('ran')")
        torch.save({**torch.load(weights, weights_only=True), "payload": payload}, weights)
        refused = r"adapter_model.bin' is refused by `torch.load\(weights_only=True\)`"
    else:
        folder, weights = safe, safe / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
        refused = "is not a complete safetensors file"
    cache = tmp_path / "cache"
    write_hub_snapshot(cache, "user/adapter", folder, commit_hash(damage), refs=("main",))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    keys = set(model.state_dict())
    with pytest.raises(ValueError, match=rf"Cannot load the Bitune adapter 'user/adapter': .*{refused}"):
        model.load_adapter("user/adapter", adapter_name="second", cache_dir=str(cache))
    assert list(model.peft_config) == ["default"] and set(model.state_dict()) == keys
    assert not marker.exists()


def truncated_pickle(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def pickled_list(path: Path) -> None:
    torch.save(list(torch.load(path, weights_only=True).values()), path)


def pickle_made_a_folder(path: Path) -> None:
    path.unlink()
    path.mkdir()


def dangling_pickle_link(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.parent / "moved-away.bin")


BROKEN_PICKLES = {
    truncated_pickle: "is not a complete pickle of weights .*; it is truncated, empty or damaged",
    pickled_list: "holds a list that is not the adapter's weights",
    pickle_made_a_folder: "is a folder; it must be the adapter's weights file",
    dangling_pickle_link: r"is a symbolic link to .*moved-away.bin', which does not exist",
}


@pytest.mark.parametrize("breakage", list(BROKEN_PICKLES), ids=lambda f: f.__name__)
def test_a_pickle_peft_could_not_read_is_refused_before_the_adapter_is_added(load_base, tmp_path, breakage):
    _, folder = pickle_and_safetensors_saves(build(load_base, "lora"), tmp_path)
    path = folder / "adapter_model.bin"
    breakage(path)
    base = load_base("llama")
    names = [name for name, _ in base.named_modules()]
    refused = rf"'{re.escape(str(path))}'.* {BROKEN_PICKLES[breakage]}.*Nothing was loaded"
    with pytest.raises(ValueError, match=refused):
        PeftModel.from_pretrained(base, folder)
    assert [name for name, _ in base.named_modules()] == names


# torch's registry of module-registration hooks, which applies to every module of the process: peft-bitune adds none.
REGISTRATION_HOOKS = torch.nn.modules.module._global_module_registration_hooks


def test_importing_registers_no_module_registration_hook():
    code = (
        "import torch, peft, transformers\n"
        "hooks = torch.nn.modules.module._global_module_registration_hooks\n"
        "before = len(hooks)\n"
        "import peft_bitune\n"
        "assert len(hooks) == before, len(hooks) - before\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


class RecordingHooks(OrderedDict):
    """torch's registry of module-registration hooks, recording every hook added to it, even one removed again."""

    def __init__(self, hooks: dict) -> None:
        super().__init__(hooks)
        self.added: list = []

    def __setitem__(self, key, value) -> None:
        self.added.append(value)
        super().__setitem__(key, value)


def test_building_saving_and_loading_bitune_models_registers_no_module_registration_hook(
    load_base, tmp_path, monkeypatch
):
    before = dict(REGISTRATION_HOOKS)
    recording = RecordingHooks(REGISTRATION_HOOKS)
    monkeypatch.setattr(torch.nn.modules.module, "_global_module_registration_hooks", recording)
    BituneModel(load_base("llama"), BituneConfig(), "default")  # a tuner never attached to a PeftModel
    assert dict(recording) == before
    models = [build(load_base, "lora", seed=seed) for seed in range(3)]
    _, pickled = pickle_and_safetensors_saves(models[0], tmp_path)
    models[1].load_adapter(str(pickled), adapter_name="second")
    PeftModel.from_pretrained(load_base("llama"), tmp_path / "safe")
    assert recording.added == []
    assert dict(recording) == before


def test_inner_modules_to_save_are_refused_rather_than_left_out():
    # Refused when the config is made, before any training; the save-time check stays as a second line.
    config = LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"], init_lora_weights=False)
    with pytest.raises(ValueError, match="modules_to_save"):
        BituneConfig(adapter_config=config)


def test_pickled_weights_in_a_hub_repo_load_like_a_local_pickled_save(load_base, tmp_path, monkeypatch):
    import huggingface_hub

    model = build(load_base, "lora")
    safe, pickled = pickle_and_safetensors_saves(model, tmp_path)
    cache = tmp_path / "cache"
    write_hub_snapshot(cache, "user/adapter", safe, commit_hash("safe"), refs=("main",))
    write_hub_snapshot(cache, "user/adapter", pickled, commit_hash("pickled"), refs=("old",))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    want = adapter_tensors(model)
    for revision in ("old", commit_hash("pickled"), None):
        loaded = PeftModel.from_pretrained(load_base("llama"), "user/adapter", cache_dir=str(cache), revision=revision)
        got = adapter_tensors(loaded)
        assert got.keys() == want.keys() and all(torch.equal(got[name], want[name]) for name in want), revision


def test_biases_trained_by_the_inner_method_round_trip(load_base, tmp_path):
    """With one shared weight set, PEFT allows `bias="lora_only"`: the base layers' biases then train and are saved."""
    config = LoraConfig(bias="lora_only", **LORA)
    model = make_bitune(load_base("qwen2"), adapter_config=config, shared_weights=True)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad and name.endswith("base_layer.bias"):
                param.add_(1.0)
    model.save_pretrained(tmp_path)
    assert any(key.endswith("q_proj.base_layer.bias") for key in load_file(tmp_path / "adapter_model.safetensors"))
    loaded = dict(PeftModel.from_pretrained(load_base("qwen2"), tmp_path).named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(loaded[name], param), name


def test_transformers_own_adapter_loading_is_refused(load_base, tmp_path):
    """transformers' `load_adapter` would inject the layers and run the causal weights alone."""
    build(load_base, "lora").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="shared state stored on the tuner"):
        load_base("llama").load_adapter(str(tmp_path))
