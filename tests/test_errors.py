"""Clear errors before any compute: bad configs, unsupported models, bad training inputs; merge is refused."""

from __future__ import annotations

import pytest
import torch
from peft import AdaLoraConfig, LoraConfig, PromptTuningConfig, get_peft_model

from peft_bitune import BituneConfig
from peft_bitune.tuner.checks import has_holes
from peft_bitune.tuner.passes import BitunePasses
from reference import make_bitune
from tiny_models import COMMON, VOCAB


@pytest.mark.parametrize(
    ("adapter_config", "message"),
    [
        (PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4), "prompt-learning method"),
        (AdaLoraConfig(total_step=10), "only one trainable adapter"),
        ({"peft_type": "NOT_A_METHOD"}, "known PEFT method"),
        ("lora", "must be a PEFT config"),
    ],
)
def test_unusable_peft_methods_are_refused_in_the_config(adapter_config, message):
    with pytest.raises((ValueError, TypeError), match=message):
        BituneConfig(adapter_config=adapter_config)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(mix_scale=0.0), "`mix_scale` must be positive"),
        (dict(mix_init=-1.0), "`mix_init` must be non-negative"),
        (dict(second_pass_attention="sideways"), "`second_pass_attention` must be one of"),
        (dict(task_type="SEQ_CLS"), "decoder-only language models"),
    ],
)
def test_bad_config_values_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BituneConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(train_mixing="no"), "`train_mixing` must be true or false, got 'no'"),
        (dict(shared_weights=1), "`shared_weights` must be true or false, got 1"),
        (dict(inference_mode="yes"), "`inference_mode` must be true or false, got 'yes'"),
        (dict(mix_scale=float("inf")), "`mix_scale` must be a finite number, got inf"),
        (dict(mix_init=float("nan")), "`mix_init` must be a finite number, got nan"),
        (dict(mix_init="abc"), "`mix_init` must be a finite number, got 'abc'"),
        (dict(mix_init=True), "`mix_init` must be a finite number, got True"),
        (dict(multi_turn=None), r"`multi_turn` must be one of \['alternating', 'history'\], got None"),
        (dict(adapter_config={"peft_type": "LORA", "r": "8"}), "`adapter_config.r` must be a finite number, got '8'"),
        (dict(adapter_config={"peft_type": "LORA", "use_dora": "false"}), "`adapter_config.use_dora` must be true"),
        (dict(adapter_config={"peft_type": "LORA", "bias": "some"}), "`adapter_config.bias` must be one of"),
    ],
)
def test_config_values_of_the_wrong_type_are_refused_by_name(kwargs, message):
    """JSON gives any type: "no" is a truthy string, Infinity a float, "8" a string PEFT compares with 0."""
    with pytest.raises(ValueError, match=message):
        BituneConfig(**kwargs)


def test_config_values_of_the_right_types_are_kept():
    config = BituneConfig(
        mix_init=1, mix_scale=0.5, train_mixing=False, inference_mode=True,
        adapter_config={"peft_type": "LORA", "r": 4, "lora_alpha": 8.0, "target_modules": ["q_proj"]},
    )
    assert (config.mix_init, config.mix_scale, config.train_mixing, config.inference_mode) == (1, 0.5, False, True)
    assert config.adapter_config.r == 4 and config.adapter_config.lora_alpha == 8.0


def test_default_adapter_config_is_the_papers_lora():
    config = BituneConfig()
    assert config.adapter_config.r == 8 and config.adapter_config.lora_alpha == 16
    assert config.adapter_config.target_modules == "all-linear"
    assert config.to_dict()["adapter_config"]["peft_type"] == "LORA"


def test_models_without_a_kv_cache_decoder_are_refused_at_get_peft_model():
    from transformers import BertConfig, BertModel, T5Config, T5ForConditionalGeneration

    bert = BertModel(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=32))
    with pytest.raises(ValueError, match="causal language model"):
        get_peft_model(bert, BituneConfig(adapter_config=LoraConfig(target_modules=["query", "value"])))
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1,
                                             num_heads=2))
    with pytest.raises(ValueError, match="encoder-decoder"):
        get_peft_model(t5, BituneConfig(adapter_config=LoraConfig(target_modules=["q", "v"])))


def hybrid_recurrent_configs():
    """Tiny hybrids whose cache holds a recurrent state: a Qwen3-Next linear-attention (gated delta net) layer before
    a full-attention one, and Falcon-H1, whose every layer runs attention and Mamba side by side."""
    from transformers import FalconH1Config, Qwen3NextConfig

    return [
        pytest.param(Qwen3NextConfig(
            num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention"],
            linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            **COMMON), "`linear_attention`", id="qwen3_next"),
        pytest.param(FalconH1Config(
            num_key_value_heads=2, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8,
            mamba_chunk_size=8, **COMMON), "`hybrid`", id="falcon_h1"),
    ]


@pytest.mark.parametrize(("config", "layer_type"), hybrid_recurrent_configs())
def test_models_with_recurrent_layers_are_refused_at_get_peft_model(config, layer_type):
    """transformers' own words otherwise come at the first forward: "Cannot get recurrent state for non linear
    attention layer 0 of type PassCacheLayer"."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_config(config)
    refusal = f"layer 0 \\({layer_type}\\) has a linear-attention or Mamba part.*recurrent state"
    with pytest.raises(ValueError, match=refusal):
        get_peft_model(base, BituneConfig(adapter_config=LoraConfig(target_modules=["q_proj", "v_proj"])))
    assert not any("lora_" in name for name, _ in base.named_parameters()), "weights were created before the refusal"


def test_merge_is_refused_with_the_reason(load_base):
    model = make_bitune(load_base("llama"))
    with pytest.raises(ValueError, match="cannot be merged"):
        model.merge_and_unload()
    with pytest.raises(ValueError, match="cannot be merged"):
        model.base_model.merge_adapter()


def test_weighted_adapter_combination_is_refused_with_the_reason(load_base):
    model = make_bitune(load_base("llama"))
    model.add_adapter("other", BituneConfig())
    with pytest.raises(ValueError, match="cannot be combined with `add_weighted_adapter`"):
        model.add_weighted_adapter(["default", "other"], [0.5, 0.5], "combined")  # PeftModel forwards it to the tuner
    assert "combined" not in model.peft_config


def _batch():
    ids = torch.randint(3, VOCAB, (2, 6))
    labels = ids.clone()
    labels[:, :3] = -100
    return ids, labels


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda ids, labels: dict(input_ids=ids), "needs the instruction/answer boundary"),
        (lambda ids, labels: dict(input_ids=ids, labels=labels[:, :5]), r"`labels` has shape \(2, 5\)"),
        (lambda ids, labels: dict(input_ids=ids, labels=torch.full_like(labels, -100)), "no answer token"),
        (lambda ids, labels: dict(input_ids=ids, labels=ids), r"Rows \[0, 1\] are supervised at every token"),
        (lambda ids, labels: dict(input_ids=ids, labels=labels.index_put((torch.tensor([1]), torch.tensor([0])),
                                                                          ids[1, :1])),
         r"Rows \[1\] start with an answer token"),
        (lambda ids, labels: dict(input_ids=ids, labels=labels,
                                  attention_mask=torch.tensor([[1, 1, 0, 1, 1, 1], [1] * 6])), "padding between"),
        (lambda ids, labels: dict(input_ids=ids, labels=labels, attention_mask=torch.zeros_like(ids)), "empty"),
        (lambda ids, labels: dict(input_ids=ids, labels=labels, prompt_mask=torch.ones_like(ids)), "no answer token"),
        (lambda ids, labels: dict(input_ids=ids, labels=labels, output_attentions=True), "not supported"),
        (lambda ids, labels: dict(labels=labels), "exactly one of `input_ids` and `inputs_embeds`"),
    ],
    ids=["no-boundary", "shape", "no-answer", "whole-row-supervised", "no-instruction", "holes", "empty",
         "all-prompt", "attentions", "no-input"],
)
def test_bad_training_inputs_get_clear_errors_before_any_compute(load_base, monkeypatch, change, message):
    model = make_bitune(load_base("llama"))
    ran = []
    monkeypatch.setattr(BitunePasses, "prompt_pass", lambda *a, **k: ran.append(1))
    ids, labels = _batch()
    with pytest.raises((ValueError, NotImplementedError), match=message):
        model(**change(ids, labels))
    assert not ran


def test_a_hole_is_padding_between_real_tokens_of_a_row():
    mask = torch.tensor([
        [1, 1, 1, 1],  # no padding
        [0, 0, 1, 1],  # left padding
        [1, 1, 0, 0],  # right padding
        [0, 1, 1, 0],  # both sides
        [0, 0, 0, 0],  # all padding: no hole (refused elsewhere as empty)
        [1, 0, 1, 1],  # a hole
        [0, 1, 0, 1],  # a hole after left padding
    ])
    assert has_holes(mask).tolist() == [False] * 5 + [True] * 2


def test_inputs_embeds_give_the_same_result_as_input_ids(load_base):
    model = make_bitune(load_base("qwen3"))
    ids, labels = _batch()
    from_ids = model(input_ids=ids, labels=labels)
    embeds = model.get_input_embeddings()(ids)
    from_embeds = model(inputs_embeds=embeds, labels=labels)
    torch.testing.assert_close(from_embeds.loss, from_ids.loss)
    torch.testing.assert_close(from_embeds.logits, from_ids.logits)


def test_ordinary_position_ids_give_the_same_result_as_none(load_base):
    model = make_bitune(load_base("llama"))
    ids, labels = _batch()
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1] * 6])
    labels[0, 0] = -100
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    expected = model(input_ids=ids, attention_mask=mask, labels=labels)
    given = model(input_ids=ids, attention_mask=mask, labels=labels, position_ids=positions)
    torch.testing.assert_close(given.loss, expected.loss, rtol=0, atol=0)
    torch.testing.assert_close(given.logits, expected.logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (dict(position_ids=torch.arange(6)[None] + 5), r"`position_ids` start example 0 \(row 0, columns 0..5\) at 5"),
        (dict(cache_position=torch.arange(6)), "does not accept `cache_position`"),
        (dict(token_type_ids=torch.zeros(2, 6, dtype=torch.long)), "does not accept `token_type_ids`"),
        (dict(logits_to_keep=2), "does not accept `logits_to_keep`"),
        (dict(cu_seq_lens_q=torch.tensor([0, 3, 6])), r"`cu_seq_lens_\*` \(\[0, 3, 6\]\) must cover the one row"),
    ],
    ids=["shifted-positions", "cache-position", "token-type-ids", "logits-to-keep", "flash-boundaries-of-two-rows"],
)
def test_forward_arguments_the_passes_cannot_share_are_refused_by_name(load_base, monkeypatch, extra, message):
    model = make_bitune(load_base("llama"))
    ran = []
    monkeypatch.setattr(BitunePasses, "prompt_pass", lambda *a, **k: ran.append(1))
    ids, labels = _batch()
    with pytest.raises(ValueError, match=message):
        model(input_ids=ids, labels=labels, **extra)
    assert not ran


def test_an_empty_or_too_long_training_batch_is_refused_before_any_compute(load_base, monkeypatch):
    model = make_bitune(load_base("llama"))
    ran = []
    monkeypatch.setattr(BitunePasses, "prompt_pass", lambda *a, **k: ran.append(1))
    empty = torch.zeros(0, 6, dtype=torch.long)
    with pytest.raises(ValueError, match="The batch is empty"):
        model(input_ids=empty, labels=empty)
    # As `generate` refuses such a prompt (see test_generate.py), the training forward refuses such a row.
    long = torch.randint(3, VOCAB, (1, 300))
    labels = long.clone()
    labels[:, :200] = -100
    with pytest.raises(ValueError, match="300 tokens, more than the model's 256 positions"):
        model(input_ids=long, labels=labels)
    assert not ran
