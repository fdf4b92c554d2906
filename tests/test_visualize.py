"""`peft_bitune.visualize` and the examples built on it: attention maps of the two prompt passes (against a per-row
reference with hand-made masks), mixing coefficients from a model and from a saved adapter, the PNG files, and the
LoRA-vs-Bitune Markdown comparison script."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model

from peft_bitune import BituneConfig
from peft_bitune.visualize import (
    attention_maps,
    mixing_coefficients,
    mixing_history,
    plot_attention_maps,
    plot_mixing_coefficients,
    plot_mixing_history,
    plot_prompt_attention,
)
from reference import alphas, make_bitune
from tiny_models import ARCHITECTURES, VOCAB

REPO = Path(__file__).resolve().parents[1]
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def load_example(name: str):
    """A script of examples/ as a module (registered in `sys.modules`, as dataclasses need)."""
    module_name = f"examples_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, REPO / "examples" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


def prompts(length: int = 9, padding: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts: row 0 fills the width, row 1 is 3 tokens shorter and padded on `padding`."""
    generator = torch.Generator().manual_seed(5)
    input_ids = torch.randint(3, VOCAB, (2, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    pad = slice(0, 3) if padding == "left" else slice(length - 3, length)
    attention_mask[1, pad] = 0
    input_ids[1, pad] = 0
    return input_ids, attention_mask


def reference_maps(model, row_prompt: torch.Tensor, layer=None, head=None) -> dict[str, torch.Tensor]:
    """
    One unpadded prompt, straight through transformers: prompt[:-1] under each weight set, the bidirectional pass
    with an explicit all-zero additive 4D mask (eager adds it to the scores), then the plain average.
    """
    bitune = model.base_model
    layer = None if layer is None else layer % bitune.model.config.num_hidden_layers
    tokens = row_prompt[None, :-1]
    length = tokens.shape[1]
    maps = {}
    for weight_set, mask in (("causal", None), ("bidirectional", torch.zeros(1, 1, length, length))):
        with bitune.weights(weight_set), torch.no_grad():
            attentions = bitune.model(input_ids=tokens, attention_mask=mask, output_attentions=True).attentions
        stacked = torch.stack(attentions)[:, 0]  # (layers, heads, seq, seq)
        stacked = stacked[layer : layer + 1] if layer is not None else stacked
        stacked = stacked[:, head : head + 1] if head is not None else stacked
        maps[weight_set] = stacked.mean(dim=(0, 1))
    return maps


# ---------------------------------------------------------------------------------------------------- attention maps
# gpt-oss's attention sinks (a learned logit per head in every softmax, with no value) take a share of every row.
@pytest.mark.parametrize("arch", [arch for arch in ARCHITECTURES if arch != "gpt_oss"])
def test_maps_are_row_stochastic_masked_and_shaped_like_the_prompt_passes(load_base, arch):
    model = make_bitune(load_base(arch))
    input_ids, attention_mask = prompts(length=9, padding="left")
    maps = attention_maps(model, input_ids, attention_mask)

    # The prompt passes read prompt[:-1]: 8 positions, row 1 has 3 padding positions on the left.
    assert maps.causal.shape == maps.bidirectional.shape == (2, 8, 8)
    assert torch.equal(maps.input_ids, input_ids[:, :-1])
    assert torch.equal(maps.attention_mask, attention_mask[:, :-1])
    real = maps.attention_mask.bool()
    upper = torch.ones(8, 8, dtype=torch.bool).triu(diagonal=1)
    # Sliding-window layers attend within a bidirectional window: check the pairs every layer can see.
    window = getattr(model.base_model.model.config, "sliding_window", None) or 8
    within_window = torch.ones(8, 8, dtype=torch.bool).tril(diagonal=window - 1)
    for row in range(2):
        for name, matrix in (("causal", maps.causal[row]), ("bidirectional", maps.bidirectional[row])):
            torch.testing.assert_close(matrix[real[row]].sum(-1), torch.ones(int(real[row].sum())), msg=name)
            assert torch.all(matrix[:, ~real[row]] == 0), f"{name} attends to padding"
            assert torch.all(matrix[~real[row]] == 0), f"{name} has a row for a padding token"
        assert torch.all(maps.causal[row][upper] == 0)
        real_pairs = upper & within_window & real[row][:, None] & real[row][None, :]
        assert bool((maps.bidirectional[row][real_pairs] > 1e-4).all()), "bidirectional map is lower-triangular"


@pytest.mark.parametrize("padding", ["left", "right"])
def test_padded_batch_matches_each_unpadded_prompt_run_alone(load_base, padding):
    model = make_bitune(load_base("llama"))
    input_ids, attention_mask = prompts(length=9, padding=padding)
    maps = attention_maps(model, input_ids, attention_mask)
    for row in range(2):
        real = attention_mask[row].bool()
        expected = reference_maps(model, input_ids[row][real])
        kept = maps.attention_mask[row].bool()
        for name in ("causal", "bidirectional"):
            actual = getattr(maps, name)[row][kept][:, kept]
            torch.testing.assert_close(actual, expected[name], msg=f"{name}, row {row}")


@pytest.mark.parametrize(("layer", "head"), [(0, 3), (-1, None), (None, 1)])
def test_one_layer_or_head_matches_the_reference(load_base, layer, head):
    model = make_bitune(load_base("llama"))
    prompt = prompts()[0][0]
    maps = attention_maps(model, prompt, layer=layer, head=head)
    expected = reference_maps(model, prompt, layer=layer, head=head)
    assert maps.layer == (None if layer is None else layer % 2)
    assert maps.head == head
    for name in ("causal", "bidirectional"):
        torch.testing.assert_close(getattr(maps, name)[0], expected[name])


def test_each_pass_uses_its_own_weights(load_base):
    """With the causal-second-pass ablation both passes share the mask, so only the weight sets can differ."""
    separate = attention_maps(make_bitune(load_base("llama"), second_pass_attention="causal"), prompts()[0])
    shared = attention_maps(
        make_bitune(load_base("llama"), second_pass_attention="causal", shared_weights=True), prompts()[0]
    )
    upper = torch.ones(8, 8, dtype=torch.bool).triu(diagonal=1)
    assert torch.all(separate.bidirectional[:, upper] == 0), "the causal ablation must draw a causal second pass"
    assert not torch.allclose(separate.causal, separate.bidirectional, atol=1e-4)
    torch.testing.assert_close(shared.causal, shared.bidirectional)


def test_sdpa_model_is_switched_to_eager_and_back(load_base):
    eager = make_bitune(load_base("llama", attn_implementation="eager"))
    sdpa = make_bitune(load_base("llama", attn_implementation="sdpa"))
    input_ids, attention_mask = prompts()
    expected = attention_maps(eager, input_ids, attention_mask)
    actual = attention_maps(sdpa, input_ids, attention_mask)
    assert sdpa.base_model.model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(actual.causal, expected.causal)
    torch.testing.assert_close(actual.bidirectional, expected.bidirectional)


def test_attention_implementation_and_training_mode_restored_after_an_error(load_base, monkeypatch):
    model = make_bitune(load_base("llama", attn_implementation="sdpa"))
    model.train()
    model.base_model.model.lm_head.eval()  # a module whose own flag differs must keep it
    decoder = model.base_model.model.get_decoder()

    def failing_forward(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(decoder, "forward", failing_forward)
    with pytest.raises(RuntimeError, match="boom"):
        attention_maps(model, prompts()[0])
    assert model.base_model.model.config._attn_implementation == "sdpa"
    assert model.training and decoder.training and not model.base_model.model.lm_head.training


def test_dropout_is_off_while_drawing_a_model_in_training_mode(load_base):
    adapter = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, lora_dropout=0.5)
    model = make_bitune(load_base("llama"), adapter_config=adapter)
    model.train()
    first = attention_maps(model, prompts()[0])
    second = attention_maps(model, prompts()[0])
    torch.testing.assert_close(first.bidirectional, second.bidirectional, rtol=0, atol=0)
    assert model.training


def test_bad_inputs_are_refused_before_any_pass(load_base):
    model = make_bitune(load_base("llama"))
    with pytest.raises(ValueError, match="fewer than 2 tokens"):
        attention_maps(model, torch.tensor([[0, 0, 5]]), torch.tensor([[0, 0, 1]]))
    with pytest.raises(ValueError, match="padding between real tokens"):
        attention_maps(model, torch.tensor([[4, 5, 6, 7]]), torch.tensor([[1, 0, 1, 1]]))
    with pytest.raises(ValueError, match=r"`layer` must be in \[-2, 1\]"):
        attention_maps(model, prompts()[0], layer=2)
    with pytest.raises(ValueError, match=r"`head` must be in \[-4, 3\]"):
        attention_maps(model, prompts()[0], head=-5)
    with pytest.raises(ValueError, match="`attention_mask` has shape"):
        attention_maps(model, prompts()[0], torch.ones(2, 3))
    lora = get_peft_model(load_base("llama"), LoraConfig(target_modules="all-linear"))
    with pytest.raises(TypeError, match="Expected a Bitune model"):
        attention_maps(lora, prompts()[0])


# ---------------------------------------------------------------------------------------------------- mixing
def test_mixing_coefficients_from_model_and_from_saved_adapter(load_base, tmp_path):
    model = make_bitune(load_base("llama"))
    key_alpha, value_alpha = alphas(model)
    from_model = mixing_coefficients(model)
    torch.testing.assert_close(from_model["keys"], key_alpha.detach())
    torch.testing.assert_close(from_model["values"], value_alpha.detach())

    model.save_pretrained(tmp_path)
    from_file = mixing_coefficients(tmp_path)
    torch.testing.assert_close(from_file["keys"], key_alpha.detach())
    torch.testing.assert_close(from_file["values"], value_alpha.detach())


def test_mixing_coefficients_of_a_named_adapter(load_base, tmp_path):
    model = make_bitune(load_base("llama"))
    model.add_adapter(
        "second", BituneConfig(adapter_config=LoraConfig(r=4, target_modules="all-linear"), mix_scale=0.02)
    )
    with torch.no_grad():
        model.base_model.bitune_mixers["second"].key_weights.copy_(torch.tensor([0.02, 0.06]))
        model.base_model.bitune_mixers["second"].value_weights.copy_(torch.tensor([0.0, 0.18]))
    expected = {"keys": torch.tensor([0.5, 0.75]), "values": torch.tensor([0.0, 0.9])}
    from_model = mixing_coefficients(model, adapter_name="second")
    model.save_pretrained(tmp_path)
    from_file = mixing_coefficients(tmp_path, adapter_name="second")
    for coefficients in (from_model, from_file):
        torch.testing.assert_close(coefficients["keys"], expected["keys"])
        torch.testing.assert_close(coefficients["values"], expected["values"])
    with pytest.raises(ValueError, match="Adapter `third` not found"):
        mixing_coefficients(model, adapter_name="third")


def test_mixing_coefficients_refuse_a_directory_that_is_not_a_bitune_adapter(load_base, tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter_config.json does not exist"):
        mixing_coefficients(tmp_path)
    get_peft_model(load_base("llama"), LoraConfig(target_modules="all-linear")).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'LORA' adapter, not a Bitune one"):
        mixing_coefficients(tmp_path)


# ---------------------------------------------------------------------------------------------------- pictures
def assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def test_pngs_of_attention_maps_and_mixing_coefficients_are_written(load_base, tmp_path):
    model = make_bitune(load_base("llama"))
    tokenizer = load_example("compare_answers").build_char_tokenizer(str(tmp_path / "tokenizer"))
    maps = attention_maps(model, *prompts())
    saved = tmp_path / "adapter"
    model.save_pretrained(saved)

    plot_attention_maps(maps, row=1, path=tmp_path / "maps.png", title="two passes")
    plot_prompt_attention(model, tokenizer, "sort 3142:", layer=0, head=1, path=tmp_path / "prompt.png")
    plot_mixing_coefficients(model, path=tmp_path / "mixing_model.png")
    plot_mixing_coefficients(saved, path=tmp_path / "mixing_file.png")
    for name in ("maps", "prompt", "mixing_model", "mixing_file"):
        assert_png(tmp_path / f"{name}.png")


def test_figures_label_axes_with_the_tokens_the_passes_read(load_base, tmp_path):
    model = make_bitune(load_base("llama"))
    tokenizer = load_example("compare_answers").build_char_tokenizer(str(tmp_path / "tokenizer"))
    figure = plot_prompt_attention(model, tokenizer, "sort 31:")
    causal_axes = figure.axes[0]
    assert [label.get_text() for label in causal_axes.get_xticklabels()] == list("sort") + ["' '", "3", "1"]
    assert [label.get_text() for label in causal_axes.get_yticklabels()] == list("sort") + ["' '", "3", "1"]
    assert "Causal" in causal_axes.get_title() and "Bidirectional" in figure.axes[1].get_title()


def fake_log_history() -> list[dict]:
    """What `BituneMixingCallback` writes for 2 layers, per-layer values at steps 1 and 3, around an eval log."""
    logs = []
    for step in (1, 2, 3):
        log = {"loss": 1.0 / step, "step": step, "bitune/alpha_keys_mean": 0.5 - 0.1 * step,
               "bitune/alpha_values_mean": 0.5 + 0.1 * step}
        if step != 2:
            log.update({"bitune/alpha_keys/layer_0": 0.4 / step, "bitune/alpha_keys/layer_1": 0.6 / step,
                        "bitune/alpha_values/layer_0": 0.5 + step / 10, "bitune/alpha_values/layer_1": 0.55})
        logs.append(log)
    logs.insert(2, {"eval_loss": 0.7, "step": 2})
    return logs + [{"train_loss": 0.6, "step": 3}]


def test_mixing_history_reads_the_logged_coefficients_from_a_list_or_a_trainer_state(tmp_path):
    import json

    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": fake_log_history(), "global_step": 3}))
    for source in (fake_log_history(), tmp_path, tmp_path / "trainer_state.json"):
        history = mixing_history(source)
        assert history.steps == [1, 3] and history.mean_steps == [1, 2, 3]
        torch.testing.assert_close(history.keys, torch.tensor([[0.4, 0.6], [0.4 / 3, 0.2]]))
        torch.testing.assert_close(history.values, torch.tensor([[0.6, 0.55], [0.8, 0.55]]))
        torch.testing.assert_close(history.mean_keys, torch.tensor([0.4, 0.3, 0.2]))
    figure = plot_mixing_history(fake_log_history(), path=tmp_path / "history.png", title="toy run")
    assert_png(tmp_path / "history.png")
    keys_axes = figure.axes[0]
    assert keys_axes.get_title() == "keys" and len(keys_axes.get_lines()) == 2 + 1 + 1  # layers, mean, 0.5 line
    assert list(keys_axes.get_lines()[0].get_xdata()) == [1, 3]


def test_mixing_history_refuses_logs_without_coefficients(tmp_path):
    with pytest.raises(ValueError, match="BituneMixingCallback"):
        mixing_history([{"loss": 1.0, "step": 1}])
    with pytest.raises(FileNotFoundError, match="trainer_state.json"):
        mixing_history(tmp_path)


def test_plotting_refuses_a_missing_directory_or_row(load_base, tmp_path):
    model = make_bitune(load_base("llama"))
    maps = attention_maps(model, *prompts())
    with pytest.raises(FileNotFoundError, match="does not exist"):
        plot_attention_maps(maps, path=tmp_path / "missing" / "maps.png")
    with pytest.raises(ValueError, match=r"`row` must be in \[-2, 1\]"):
        plot_attention_maps(maps, row=2)
    with pytest.raises(ValueError, match="'keys' and 'values'"):
        plot_mixing_coefficients({"keys": torch.zeros(2)})


@pytest.mark.slow
def test_importing_the_package_does_not_import_matplotlib():
    code = "import sys, peft_bitune, peft_bitune.visualize; sys.exit('matplotlib' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


# ---------------------------------------------------------------------------------------------------- compare_answers
def test_markdown_cells_keep_the_table_intact():
    compare = load_example("compare_answers")
    assert compare.markdown_cell(" a | b\n<c> & d ") == "a \\| b<br>&lt;c&gt; &amp; d"
    assert compare.markdown_cell("   ") == "*(empty)*"
    markdown = compare.side_by_side_markdown(["q1\nmore"], ["x"], ["y"], header="h")
    assert "> q1\n> more" in markdown and "| LoRA | Bitune |\n| --- | --- |\n| x | y |" in markdown
    with pytest.raises(ValueError, match="2 prompts, 1 LoRA answers"):
        compare.side_by_side_markdown(["a", "b"], ["x"], ["y"])


def test_compare_answers_offline_demo_writes_markdown(tmp_path):
    output = tmp_path / "answers.md"
    markdown = load_example("compare_answers").main(
        ["--demo_steps", "2", "--max_new_tokens", "3", "--output", str(output)]
    )
    assert output.read_text(encoding="utf-8") == markdown
    assert markdown.count("| LoRA | Bitune |") == 4 and "## Prompt 4" in markdown
    assert markdown.count("> sort ") == 4


def test_compare_answers_with_saved_models_matches_direct_generation(tmp_path):
    """The real-model path: a saved base, a LoRA adapter and a Bitune adapter, loaded from disk."""
    compare = load_example("compare_answers")
    tokenizer = compare.build_char_tokenizer(str(tmp_path / "tokenizer"))
    compare.build_tiny_model(tokenizer, seed=0, num_layers=2).save_pretrained(tmp_path / "base")
    adapter = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    torch.manual_seed(1)
    lora = get_peft_model(compare.build_tiny_model(tokenizer, seed=0, num_layers=2), adapter)
    lora.save_pretrained(tmp_path / "lora")
    torch.manual_seed(2)
    bitune = make_bitune(compare.build_tiny_model(tokenizer, seed=0, num_layers=2), adapter_config=adapter)
    bitune.save_pretrained(tmp_path / "bitune")
    questions = ["31", "975"]

    markdown = compare.main([
        "--model_name_or_path", str(tmp_path / "base"), "--tokenizer", str(tmp_path / "tokenizer"),
        "--lora_adapter", str(tmp_path / "lora"), "--bitune_adapter", str(tmp_path / "bitune"),
        "--prompt", questions[0], "--prompt", questions[1], "--template", "sort {prompt}:",
        "--max_new_tokens", "4", "--dtype", "float32", "--output", str(tmp_path / "answers.md"),
    ])
    prompts_text = [f"sort {question}:" for question in questions]
    expected = compare.side_by_side_markdown(
        prompts_text,
        compare.generate_answers(lora, tokenizer, prompts_text, 4),
        compare.generate_answers(bitune, tokenizer, prompts_text, 4),
    )
    assert markdown.split("\n## ", 1)[1] == expected.split("\n## ", 1)[1]


def test_compare_answers_refuses_incomplete_model_arguments(tmp_path, capsys):
    compare = load_example("compare_answers")
    with pytest.raises(SystemExit):
        compare.main(["--model_name_or_path", "some/model", "--output", str(tmp_path / "a.md")])
    assert "--lora_adapter and --bitune_adapter" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compare.main(["--template", "no placeholder"])
    assert "must contain '{prompt}'" in capsys.readouterr().err
    assert not (tmp_path / "a.md").exists()


def test_make_doc_images_refuses_bad_arguments_before_any_work(tmp_path, capsys):
    with pytest.raises(SystemExit):
        load_example("make_doc_images").main(["--steps", "0", "--output_dir", str(tmp_path / "images")])
    assert "--steps must be positive" in capsys.readouterr().err
    assert not (tmp_path / "images").exists()
