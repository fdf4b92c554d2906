"""Bitune generation: consistent with training, batched, every decoding strategy, the right cost."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from peft_bitune import compat
from peft_bitune.tuner.passes import BitunePasses
from reference import left_padded, make_bitune, reference_greedy, reference_prefill
from tiny_models import ATTENTION_CASES, VOCAB

PROMPT_LENGTHS = [9, 1, 4, 12]


def prompts(seed: int = 3, lengths=PROMPT_LENGTHS) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in lengths]


def generated(output, batch) -> torch.Tensor:
    sequences = output.sequences if hasattr(output, "sequences") else output
    return sequences[:, batch["input_ids"].shape[1] :]


GREEDY = dict(max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)


@pytest.mark.parametrize(("arch", "attn_implementation"), ATTENTION_CASES)
def test_batched_greedy_equals_each_prompt_alone_and_the_training_reference(load_base, arch, attn_implementation):
    model = make_bitune(load_base(arch, attn_implementation)).eval()
    rows = prompts()
    batch = left_padded(rows)
    out = model.generate(**batch, **GREEDY, output_scores=True, return_dict_in_generate=True)
    tokens = generated(out, batch)
    for i, row in enumerate(rows):
        alone_batch = left_padded([row])
        alone = model.generate(**alone_batch, **GREEDY, output_scores=True, return_dict_in_generate=True)
        assert tokens[i].tolist() == generated(alone, alone_batch)[0].tolist()
        for step_batch, step_alone in zip(out.scores, alone.scores):
            torch.testing.assert_close(step_batch[i], step_alone[0], atol=1e-4, rtol=0)
    # The step-by-step training-style reference for the longest prompt (it crosses the sliding windows).
    longest = max(range(len(rows)), key=lambda i: len(rows[i]))
    assert tokens[longest].tolist() == reference_greedy(model, rows[longest], GREEDY["max_new_tokens"])


@pytest.mark.parametrize("arch", ["llama", "gemma3", "mistral"])
def test_greedy_tokens_are_the_argmax_of_the_training_forward(load_base, arch):
    model = make_bitune(load_base(arch)).eval()
    rows = prompts(seed=5)
    batch = left_padded(rows)
    tokens = generated(model.generate(**batch, **GREEDY), batch)
    n = tokens.shape[1]
    for row, new in zip(rows, tokens):
        sequence = torch.cat([row, new])[None]
        labels = sequence.clone()
        labels[:, : len(row)] = -100
        logits = model(input_ids=sequence, labels=labels).logits[0]
        # Logits at the last prompt token and at each generated token but the last predict the next token.
        predicted = logits[len(row) - 1 : len(row) - 1 + n].argmax(-1)
        assert predicted.tolist() == new.tolist()


def test_prefill_holds_exactly_the_mixed_keys_and_values_of_prompt_minus_last(load_base):
    model = make_bitune(load_base("gemma2")).eval()
    rows = prompts(seed=7, lengths=[5, 11])
    batch = left_padded(rows)
    cache = model.base_model.prefill(**batch)
    width = batch["input_ids"].shape[1]
    assert cache.get_seq_length() == width - 1
    for i, row in enumerate(rows):
        expected = reference_prefill(model, row[None])
        for layer, ref_layer in zip(cache.layers, expected.layers):
            kept = ref_layer.keys.shape[-2]  # a sliding layer keeps only its window
            torch.testing.assert_close(layer.keys[i : i + 1, :, -kept:], ref_layer.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(layer.values[i : i + 1, :, -kept:], ref_layer.values, atol=1e-5, rtol=0)


def test_multi_head_latent_attention_mixes_the_compressed_latent_and_the_rotary_keys(load_base):
    """DeepSeek-V3, as docs/index.md says: transformers caches each token's compressed keys/values (one head,
    `kv_lora_rank` wide) and its rotary keys (one head) in the keys and values slots, so these are what the prefill
    mixes (checked against the per-row reference); the bidirectional set's `kv_b_proj`, which expands the latent, acts
    only inside its own pass: at the last layer it shapes nothing the prefill keeps."""
    model = make_bitune(load_base("deepseek_v3")).eval()
    config = model.base_model.model.config
    rows = prompts(seed=7, lengths=[5, 11])
    batch = left_padded(rows)
    cache = model.base_model.prefill(**batch)
    width = batch["input_ids"].shape[1]
    for layer in cache.layers:
        assert layer.keys.shape == (2, 1, width - 1, config.kv_lora_rank)
        assert layer.values.shape == (2, 1, width - 1, config.qk_rope_head_dim)
    for i, row in enumerate(rows):
        expected = reference_prefill(model, row[None])
        real = slice(width - len(row), width - 1)  # the row's prompt[:-1], left-padded
        for layer, ref_layer in zip(cache.layers, expected.layers):
            torch.testing.assert_close(layer.keys[i : i + 1, :, real], ref_layer.keys, atol=1e-5, rtol=0)
            torch.testing.assert_close(layer.values[i : i + 1, :, real], ref_layer.values, atol=1e-5, rtol=0)
    last = config.num_hidden_layers - 1
    expansion = model.get_parameter(
        f"base_model.model.model.layers.{last}.self_attn.kv_b_proj.lora_B.default__bidirectional.weight"
    )
    with torch.no_grad():
        expansion.mul_(5)
    again = model.base_model.prefill(**batch)
    for layer, before in zip(again.layers, cache.layers):
        assert torch.equal(layer.keys, before.keys) and torch.equal(layer.values, before.values)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_beam_search_and_several_return_sequences_batched_equal_alone(load_base, arch):
    model = make_bitune(load_base(arch)).eval()
    rows = prompts(seed=11, lengths=[3, 8, 6])
    batch = left_padded(rows)
    settings = dict(max_new_tokens=5, num_beams=3, num_return_sequences=2, do_sample=False, eos_token_id=None,
                    pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    out = model.generate(**batch, **settings)
    tokens = generated(out, batch)
    assert tokens.shape[0] == len(rows) * 2
    for i, row in enumerate(rows):
        alone_batch = left_padded([row])
        alone = model.generate(**alone_batch, **settings)
        assert tokens[2 * i : 2 * i + 2].tolist() == generated(alone, alone_batch).tolist()
        torch.testing.assert_close(out.sequences_scores[2 * i : 2 * i + 2], alone.sequences_scores, atol=1e-4, rtol=0)


def test_seeded_sampling_is_reproducible_and_several_sequences_per_prompt_work(load_base):
    model = make_bitune(load_base("qwen2")).eval()
    batch = left_padded(prompts(seed=2, lengths=[4, 7]))
    settings = dict(max_new_tokens=8, do_sample=True, top_k=20, temperature=1.5, num_return_sequences=3,
                    eos_token_id=None, pad_token_id=0)
    torch.manual_seed(123)
    first = model.generate(**batch, **settings)
    torch.manual_seed(123)
    second = model.generate(**batch, **settings)
    assert first.shape == (6, batch["input_ids"].shape[1] + 8)
    assert torch.equal(first, second)
    assert len({tuple(t) for t in generated(first, batch).tolist()}) > 1


def test_generation_config_streamer_and_stopping_criteria_keep_working(load_base):
    from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

    model = make_bitune(load_base("phi3")).eval()
    batch = left_padded(prompts(seed=4, lengths=[6]))

    class Collect(BaseStreamer):
        def __init__(self):
            self.chunks = []

        def put(self, value):
            self.chunks.append(value.flatten().tolist())

        def end(self):
            self.chunks.append("end")

    class StopAfter(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= batch["input_ids"].shape[1] + 3)

    streamer = Collect()
    config = GenerationConfig(max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=None)
    out = model.generate(**batch, generation_config=config, streamer=streamer,
                         stopping_criteria=StoppingCriteriaList([StopAfter()]))
    new = generated(out, batch)[0].tolist()
    assert len(new) == 3
    assert streamer.chunks[0] == batch["input_ids"][0].tolist()  # the prompt is streamed first, as in transformers
    assert [c[0] for c in streamer.chunks[1:-1]] == new and streamer.chunks[-1] == "end"
    eos = new[1]
    stopped = generated(model.generate(**batch, max_new_tokens=10, do_sample=False, pad_token_id=0, eos_token_id=eos),
                        batch)[0].tolist()
    assert stopped == new[:2]


def test_decoding_reuses_the_prefill_and_never_reruns_it(load_base, monkeypatch):
    model = make_bitune(load_base("llama")).eval()
    bitune = model.base_model
    calls = []
    original = BitunePasses.prompt_pass

    def counting(self, weight_set, cache, **inputs):
        calls.append((weight_set, inputs["input_ids"].shape))
        return original(self, weight_set, cache, **inputs)

    monkeypatch.setattr(BitunePasses, "prompt_pass", counting)
    batch = left_padded(prompts(seed=8, lengths=[5, 9]))
    model.generate(**batch, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    width = batch["input_ids"].shape[1]
    assert calls == [("bidirectional", (2, width - 1)), ("causal", (2, width - 1))]

    # Every decoding step after the prefill is one causal forward over the new token only.
    seen = []
    handle = bitune.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        model.generate(**batch, max_new_tokens=5, do_sample=False, pad_token_id=0, eos_token_id=None)
    finally:
        handle.remove()
    assert seen == [1] * 5


def test_disable_adapter_generates_like_the_base_model(load_base):
    base = load_base("gemma")
    batch = left_padded(prompts(seed=9, lengths=[3, 7]))
    expected = base.generate(**batch, **GREEDY)
    model = make_bitune(base).eval()
    with model.disable_adapter():
        got = model.generate(**batch, **GREEDY)
    assert torch.equal(got, expected)
    assert not torch.equal(model.generate(**batch, **GREEDY), expected)


def test_generation_input_errors_are_clear(load_base):
    model = make_bitune(load_base("llama")).eval()
    batch = left_padded(prompts(seed=1, lengths=[3, 5]))
    empty = dict(batch, attention_mask=batch["attention_mask"].clone())
    empty["attention_mask"][0] = 0
    with pytest.raises(ValueError, match="empty"):
        model.generate(**empty, max_new_tokens=2)
    right = dict(input_ids=batch["input_ids"].flip(1), attention_mask=batch["attention_mask"].flip(1))
    with pytest.raises(ValueError, match="padding_side = 'left'"):
        model.generate(**right, max_new_tokens=2)
    too_long = torch.randint(3, VOCAB, (1, 300))
    with pytest.raises(ValueError, match="more than the model's 256 positions"):
        model.generate(input_ids=too_long, max_new_tokens=2)


def test_generate_works_in_training_mode_with_gradient_checkpointing(load_base):
    model = make_bitune(load_base("llama")).eval()
    batch = left_padded(prompts(seed=6, lengths=[4, 7]))
    expected = model.generate(**batch, **GREEDY)
    compat.enable_checkpointing(model.base_model.model, use_reentrant=False)
    model.train()
    assert torch.equal(model.generate(**batch, **GREEDY), expected)
    assert all(layer.gradient_checkpointing for layer in model.base_model.model.model.layers)


def test_generate_without_attention_mask_infers_it_from_the_pad_token_like_transformers(load_base):
    model = make_bitune(load_base("llama")).eval()
    batch = left_padded(prompts(seed=3, lengths=[8, 3]))  # pad id 0 = config.pad_token_id
    with_mask = model.generate(**batch, **GREEDY)
    without_mask = model.generate(input_ids=batch["input_ids"], **GREEDY)
    assert torch.equal(without_mask, with_mask)
    # The padding changes the answer when read as prompt tokens, so the test above can tell the two apart.
    ones = torch.ones_like(batch["input_ids"])
    assert not torch.equal(model.generate(input_ids=batch["input_ids"], attention_mask=ones, **GREEDY), with_mask)
    # As in transformers, a pad token that is also an end-of-sequence token says nothing: no padding is inferred.
    pad_is_eos = dict(GREEDY, eos_token_id=0)
    assert torch.equal(
        model.generate(input_ids=batch["input_ids"], **pad_is_eos),
        model.generate(input_ids=batch["input_ids"], attention_mask=ones, **pad_is_eos),
    )


def count_prompt_passes(model, monkeypatch) -> list[str]:
    calls = []
    original = BitunePasses.prompt_pass

    def counting(self, weight_set, cache, **inputs):
        calls.append(weight_set)
        return original(self, weight_set, cache, **inputs)

    monkeypatch.setattr(BitunePasses, "prompt_pass", counting)
    return calls


def test_use_cache_false_is_refused_before_any_compute(load_base, monkeypatch):
    from transformers import GenerationConfig

    model = make_bitune(load_base("llama")).eval()
    batch = left_padded(prompts(seed=3, lengths=[8, 3]))
    calls = count_prompt_passes(model, monkeypatch)
    with pytest.raises(ValueError, match="`use_cache=False` is not supported by Bitune"):
        model.generate(**batch, **GREEDY, use_cache=False)
    with pytest.raises(ValueError, match="`use_cache=False` is not supported by Bitune"):
        model.generate(**batch, generation_config=GenerationConfig(use_cache=False, **GREEDY))
    model.generation_config.use_cache = False
    with pytest.raises(ValueError, match="`use_cache=False` is not supported by Bitune"):
        model.generate(**batch, **GREEDY)
    assert calls == []
    model.generation_config.use_cache = True
    model.generate(**batch, **GREEDY)
    assert calls == ["bidirectional", "causal"]


def test_generation_arguments_transformers_refuses_are_refused_before_the_prefill(load_base, monkeypatch):
    model = make_bitune(load_base("llama")).eval()
    batch = left_padded(prompts(seed=3, lengths=[8, 3]))
    calls = count_prompt_passes(model, monkeypatch)
    with pytest.raises(ValueError, match="`max_new_tokens` must be greater than 0"):
        model.generate(**batch, **dict(GREEDY, max_new_tokens=0))
    assert calls == []


def test_an_empty_batch_is_refused_with_a_clear_error(load_base):
    model = make_bitune(load_base("llama")).eval()
    empty = torch.zeros(0, 5, dtype=torch.long)
    with pytest.raises(ValueError, match="non-empty"):
        model.generate(input_ids=empty, attention_mask=torch.ones_like(empty), **GREEDY)
    with pytest.raises(ValueError, match="non-empty"):
        model.base_model.prefill(empty)


def test_generate_attentions_of_the_first_step_cover_the_last_prompt_token_as_documented(load_base):
    """docs/generation.md: step 0's attentions are those of the last prompt token over the mixed cache."""
    model = make_bitune(load_base("llama")).eval()
    input_ids = torch.randint(3, VOCAB, (2, 7))
    output = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=2,
                            do_sample=False, output_attentions=True, return_dict_in_generate=True)
    config = model.base_model.model.config
    first, second = output.attentions
    assert len(first) == config.num_hidden_layers
    assert first[0].shape == (2, config.num_attention_heads, 1, 7)  # the base model gives (2, heads, 7, 7)
    assert second[0].shape == (2, config.num_attention_heads, 1, 8)
    torch.testing.assert_close(first[0].sum(-1), torch.ones(2, config.num_attention_heads, 1))


# ------------------------------------------------------------------------------------------------ assisted decoding
@pytest.mark.parametrize("assistance", ["assistant_model", "prompt_lookup_num_tokens"])
def test_assisted_generation_is_refused_before_any_compute(load_base, monkeypatch, assistance):
    model = make_bitune(load_base("llama")).eval()
    arguments = {"assistant_model": load_base("llama")} if assistance == "assistant_model" else {assistance: 3}
    calls = count_prompt_passes(model, monkeypatch)
    batch = left_padded(prompts(seed=3, lengths=[8]))
    with pytest.raises(ValueError, match=r"Assisted generation \(`assistant_model`, `prompt_lookup_num_tokens`"):
        model.generate(**batch, **GREEDY, **arguments)
    assert calls == []


def test_transformers_assisted_decoding_rereads_the_whole_input_over_a_given_cache(load_base):
    """Why assisted generation is refused: its first step re-reads the whole input from position 0 on top of the
    cache it is given (the mixed prompt cache, for Bitune), so the answer differs from plain decoding. If this fails,
    transformers changed that first step: the refusal in `generation.py` may then be lifted."""
    from transformers import DynamicCache

    base = load_base("llama")
    prompt = torch.randint(3, VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
    cache = DynamicCache(config=base.config)
    with torch.no_grad():
        base(input_ids=prompt[:, :-1], **compat.with_cache(base, cache), use_cache=True)
    widths = []
    handle = base.register_forward_pre_hook(lambda m, a, k: widths.append(k["input_ids"].shape[1]), with_kwargs=True)
    try:
        base.generate(input_ids=prompt, **compat.with_cache(base, cache), prompt_lookup_num_tokens=3, **GREEDY)
    finally:
        handle.remove()
    assert widths[0] == prompt.shape[1]  # not 1: the 9 cached positions are read a second time


# ---------------------------------------------------------------------------------------------------- inputs_embeds
def embeddings_not_of_the_ids(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Embeddings a model never sees for `input_ids` (scaled and shifted), so that a pass reading ids is noticed."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(input_ids)
        return 1.5 * embeds + 0.05 * torch.randn(embeds.shape, generator=generator)


def training_logits_from_embeddings(model, embeds: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The training forward of one unpadded row given as embeddings (allowed there), labels marking the answers."""
    with torch.no_grad():
        return model(inputs_embeds=embeds[None], labels=labels[None]).logits[0]


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_generate_with_input_ids_and_inputs_embeds_reads_the_embeddings_in_every_pass(load_base, arch):
    """As in transformers: `inputs_embeds` are what the model reads, `input_ids` name the prompt in the output. The
    reference is the training forward on the same embeddings (`inputs_embeds` alone), then the generated tokens'."""
    model = make_bitune(load_base(arch)).eval()
    embed = model.get_input_embeddings()
    rows = prompts(seed=12, lengths=[9, 4])
    batch = left_padded(rows)
    embeds = embeddings_not_of_the_ids(model, batch["input_ids"])
    settings = dict(GREEDY, output_logits=True, return_dict_in_generate=True)
    out = model.generate(**batch, inputs_embeds=embeds, **settings)
    width = batch["input_ids"].shape[1]
    assert torch.equal(out.sequences[:, :width], batch["input_ids"])
    for i, row in enumerate(rows):
        new = out.sequences[i, width:]
        with torch.no_grad():
            row_embeds = torch.cat([embeds[i, width - len(row) :], embed(new)])
        labels = torch.cat([torch.full_like(row, -100), new])
        logits = training_logits_from_embeddings(model, row_embeds, labels)
        for step in range(len(new)):
            torch.testing.assert_close(out.logits[step][i], logits[len(row) - 1 + step], atol=1e-4, rtol=0)
    # The ids alone give other answers: the test can tell which one a pass read.
    assert not torch.equal(model.generate(**batch, **GREEDY), out.sequences)

    # A continued conversation reads the new instruction's embeddings too (those of the history are in the cache).
    instruction = prompts(seed=13, lengths=[5])[0]
    conversation = torch.cat([out.sequences[:1], instruction[None]], dim=1)
    history_mask = torch.cat([batch["attention_mask"][:1], torch.ones(1, GREEDY["max_new_tokens"], dtype=torch.long)],
                             dim=1)
    mask = torch.cat([history_mask, torch.ones(1, len(instruction), dtype=torch.long)], dim=1)
    with torch.no_grad():
        conversation_embeds = torch.cat([embed(out.sequences[:1]),
                                         embeddings_not_of_the_ids(model, instruction[None])], dim=1)
    cache = compat.output_cache(out)
    cache.batch_select_indices(torch.tensor([0]))
    cache.record_conversation(out.sequences[:1], history_mask)
    second = model.generate(input_ids=conversation, attention_mask=mask, inputs_embeds=conversation_embeds,
                            cache=cache, **settings)
    real = mask[0].bool()
    new = second.sequences[0, conversation.shape[1] :]
    first_answer = out.sequences[0, width:]
    labels = torch.cat([torch.full_like(rows[0], -100), first_answer, torch.full_like(instruction, -100), new])
    with torch.no_grad():
        row_embeds = torch.cat([embeds[0, width - len(rows[0]) :], conversation_embeds[0, width:][real[width:]],
                                embed(new)])
    logits = training_logits_from_embeddings(model, row_embeds, labels)
    start = len(labels) - len(new) - 1
    for step in range(len(new)):
        torch.testing.assert_close(second.logits[step][0], logits[start + step], atol=1e-4, rtol=0)


def test_beams_over_inputs_embeds_then_a_continued_turn_equal_the_training_forward_on_the_embeddings(load_base):
    """The cache after beam search is rebuilt for the returned sequences from the input's embeddings too."""
    model = make_bitune(load_base("llama")).eval()
    embed = model.get_input_embeddings()
    prompt = prompts(seed=14, lengths=[7])[0]
    embeds = embeddings_not_of_the_ids(model, prompt[None])
    beams = dict(GREEDY, num_beams=3, num_return_sequences=3, return_dict_in_generate=True)
    out = model.generate(input_ids=prompt[None], inputs_embeds=embeds, **beams)
    instruction = prompts(seed=15, lengths=[3])[0]
    conversation = torch.cat([out.sequences, instruction.expand(3, -1)], dim=1)
    second = model.generate(input_ids=conversation, cache=compat.output_cache(out),
                            **dict(GREEDY, output_logits=True, return_dict_in_generate=True))
    width, new = len(prompt), GREEDY["max_new_tokens"]
    for row in range(3):
        answer, answer_2 = out.sequences[row, width:], second.sequences[row, conversation.shape[1] :]
        with torch.no_grad():
            row_embeds = torch.cat([embeds[0], embed(torch.cat([answer, instruction, answer_2]))])
        labels = torch.cat([torch.full_like(prompt, -100), answer, torch.full_like(instruction, -100), answer_2])
        logits = training_logits_from_embeddings(model, row_embeds, labels)
        for step in range(new):
            torch.testing.assert_close(second.logits[step][row], logits[len(labels) - new - 1 + step], atol=1e-4,
                                       rtol=0)


def test_inputs_embeds_that_do_not_embed_every_input_id_are_refused(load_base):
    model = make_bitune(load_base("llama")).eval()
    batch = left_padded(prompts(seed=3, lengths=[6]))
    embeds = model.get_input_embeddings()(batch["input_ids"])
    with pytest.raises(ValueError, match="give the embedding of every `input_ids` position"):
        model.generate(**batch, inputs_embeds=embeds[:, -1:], **GREEDY)
    with pytest.raises(ValueError, match="needs `input_ids`, also with `inputs_embeds`"):
        model.generate(inputs_embeds=embeds, **GREEDY)


# ---------------------------------------------------------------------------------------------------- positions
def llama_with(**changes):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tiny_models import COMMON

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, "num_key_value_heads": 2, **changes})).eval()


@pytest.mark.parametrize(
    "base",
    ["llama", "gemma3"],  # full attention; sliding and full layers (the full ones see every position)
)
def test_generating_past_the_models_positions_is_refused_before_the_prefill(load_base, monkeypatch, base):
    model = make_bitune(load_base(base)).eval()
    calls = count_prompt_passes(model, monkeypatch)
    batch = left_padded(prompts(seed=3, lengths=[10, 4]))
    settings = dict(GREEDY, max_new_tokens=247)
    message = r"10 tokens and `max_new_tokens=247` lets it grow to 257, past the model's 256 positions .* at most 246"
    with pytest.raises(ValueError, match=message):
        model.generate(**batch, **settings)
    with pytest.raises(ValueError, match=r"`max_length=300` lets it grow to 300"):
        model.generate(**batch, **dict(GREEDY, max_new_tokens=None, max_length=300))
    assert calls == []
    out = model.generate(**batch, **dict(settings, max_new_tokens=246), return_dict_in_generate=True)
    assert out.sequences.shape[1] == 10 + 246  # exactly the model's positions for the longest row
    # A continued conversation counts its whole history.
    out = model.generate(**batch, **dict(settings, max_new_tokens=200), return_dict_in_generate=True)
    conversation = torch.cat([out.sequences, torch.randint(3, VOCAB, (2, 4))], dim=1)
    mask = torch.cat([batch["attention_mask"], torch.ones(2, 204, dtype=torch.long)], dim=1)
    calls.clear()
    with pytest.raises(ValueError, match=r"input has 214 tokens and `max_new_tokens=43` lets it grow to 257"):
        model.generate(input_ids=conversation, attention_mask=mask, cache=compat.output_cache(out),
                       **dict(GREEDY, max_new_tokens=43))
    assert calls == []


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
        "mistral",  # a sliding window on every layer
    ],
    ids=["linear-rope-scaling", "dynamic-rope-scaling", "sliding-window-everywhere"],
)
def test_models_that_declare_more_positions_generate_past_max_position_embeddings(load_base, changes):
    model = make_bitune(load_base("mistral") if changes == "mistral" else llama_with(**changes)).eval()
    prompt = torch.randint(3, VOCAB, (1, 260), generator=torch.Generator().manual_seed(5))  # past 256 already
    out = model.generate(input_ids=prompt, **dict(GREEDY, max_new_tokens=8))
    assert out.shape[1] == 268
    assert out[0, 260:].tolist() == reference_greedy(model, prompt[0], 8)
    # One rule everywhere: a training row past 256 positions is not refused either.
    labels = out.clone()
    labels[:, :260] = -100
    assert torch.isfinite(model(input_ids=out, labels=labels).loss)


@pytest.mark.parametrize(("arch", "attn_implementation"),
                         [("llama", "eager"), ("llama", "sdpa"), ("gemma", "eager"), ("phi3", "sdpa")])
def test_padding_between_real_tokens_is_read_as_transformers_reads_it(load_base, arch, attn_implementation):
    """A 0 between 1s in a prompt's `attention_mask` (as in PEFT's own generate tests) is a token no position counts
    and no token sees, as transformers reads it: `prefill` and `generate` give that row what they give the row
    without the masked token, left-padded instead."""
    model = make_bitune(load_base(arch, attn_implementation)).eval()
    first, second = prompts(seed=11, lengths=[7, 6])
    holed = {"input_ids": torch.stack([first, torch.cat([second[:2], torch.tensor([5]), second[2:]])]),
             "attention_mask": torch.tensor([[1] * 7, [1, 1, 0, 1, 1, 1, 1]])}
    removed = left_padded([first, second])
    holed_cache, removed_cache = model.base_model.prefill(**holed), model.base_model.prefill(**removed)
    real = [0, 1, 3, 4, 5]  # the second row's real columns of the prompt minus its last token, in each batch
    for with_hole, without in zip(holed_cache.layers, removed_cache.layers):
        for name in ("keys", "values"):
            torch.testing.assert_close(getattr(with_hole, name)[1, :, real], getattr(without, name)[1, :, 1:],
                                       atol=1e-5, rtol=0)
    outputs = [model.generate(**batch, **GREEDY, output_scores=True, return_dict_in_generate=True)
               for batch in (holed, removed)]
    assert generated(outputs[0], holed).tolist() == generated(outputs[1], removed).tolist()
    for step_holed, step_removed in zip(outputs[0].scores, outputs[1].scores):
        torch.testing.assert_close(step_holed, step_removed, atol=1e-4, rtol=0)


def test_padding_between_real_tokens_is_refused_by_sliding_window_layers(load_base):
    """A sliding window counts cache columns, so a hole would widen it by a token: refused, before any compute."""
    model = make_bitune(load_base("gemma3")).eval()
    batch = {"input_ids": torch.stack(prompts(seed=11, lengths=[5, 5])), "attention_mask": torch.tensor(
        [[1] * 5, [1, 0, 1, 1, 1]])}
    for call in (model.base_model.prefill, lambda **inputs: model.generate(**inputs, **GREEDY)):
        with pytest.raises(ValueError, match="sliding-window layers, whose window is counted in cache columns"):
            call(**batch)
