"""Mixed-adapter batches (PEFT's `adapter_names`), run as one batch: every row gets exactly what its own adapter gives
it in the same batch, and what it gives the row's group alone to float32 rounding of the batch's shape, in the forward
(logits and loss), `prefill` and `generate`, multi-turn included, with two and three adapters."""

from __future__ import annotations

import pytest
import torch
from peft import IA3Config, LoraConfig
from transformers.generation.streamers import BaseStreamer

from peft_bitune import BituneConfig, compat
from reference import left_padded, make_bitune, padded_batch, reference_greedy, reference_prefill, reference_row
from test_multi_turn import ROWS, make_conversations, reference_alternating
from tiny_models import VOCAB

# Adapters that differ in weights, mixing scalars and settings, so that a row run with the wrong one fails.
ADAPTERS = {
    "default": {},
    "other": dict(second_pass_attention="causal", mix_scale=0.02),
    "third": dict(shared_weights=True, mixed_layers=[1]),
}
# Rows of the same adapter are not neighbours, and the first row is not the active adapter's.
ROUTES = {
    2: ["other", "default", "other", "default"],
    3: ["third", "default", "other", "third"],
}
GREEDY = dict(max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)


def with_adapters(base, count: int):
    """A Bitune model with `count` adapters of `ADAPTERS`, each with random weights and mixing scalars; `default`
    active."""
    model = make_bitune(base)
    for seed, (name, settings) in enumerate(list(ADAPTERS.items())[1:count], start=1):
        torch.manual_seed(seed)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
        model.add_adapter(name, BituneConfig(adapter_config=lora, **settings))
        with torch.no_grad():
            model.base_model.bitune_mixers[name].key_weights.uniform_(0.002, 0.2)
            model.base_model.bitune_mixers[name].value_weights.uniform_(0.002, 0.2)
    model.set_adapter("default")
    return model.eval()


def rows_by_adapter(names: list[str]) -> dict[str, list[int]]:
    return {name: [i for i, n in enumerate(names) if n == name] for name in dict.fromkeys(names)}


def alone(model, name: str, run):
    """`run()` with `name` active (`set_adapter`), then `default` again."""
    model.set_adapter(name)
    try:
        return run()
    finally:
        model.set_adapter("default")


def select(batch: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    return {key: value[rows] for key, value in batch.items()}


# A mixed batch's rows against the same rows run with their adapter in a batch of their own: equal to float32
# rounding, since the same rows in batches of other shapes (the rows' group alone; the per-row LoRA products of each
# adapter's rows) round differently by a few ulps. Measured up to about 1e-6 on these models' logits and keys, the same
# as one adapter's batch of four rows against two of them; the adapters differ by more than 1e-3 (asserted below).
ROUNDING = dict(atol=1e-5, rtol=0)


def assert_as_alone(mixed: torch.Tensor, own: torch.Tensor) -> None:
    torch.testing.assert_close(mixed, own, **ROUNDING)


def second_pass_causal(name: str) -> bool:
    return ADAPTERS[name].get("second_pass_attention") == "causal"


# ------------------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("padding_side", ["left", "right"])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_forward_rows_equal_each_adapter_alone_and_the_per_row_reference(load_base, arch, padding_side, count):
    model = with_adapters(load_base(arch), count)
    names = ROUTES[count]
    rows, batch, _ = padded_batch(padding_side, VOCAB)
    prompt_lengths = [1, 3, 7, 9]
    with torch.no_grad():
        out = model(**batch, adapter_names=names)
        direct = model.base_model(**batch, adapter_names=names)  # the tuner takes them as PEFT's forward does
        assert torch.equal(out.logits, direct.logits)
        loss_sum, supervised = 0.0, 0
        for name, group in rows_by_adapter(names).items():
            own = alone(model, name, lambda group=group: model(**select(batch, group)))
            assert_as_alone(out.logits[group], own.logits)
            for i in group:
                logits, row_loss = alone(model, name, lambda i=i: reference_row(
                    model, rows[i], prompt_lengths[i], second_pass_causal(name)))
                start = int(batch["attention_mask"][i].argmax())
                got = out.logits[i, start + prompt_lengths[i] - 1 : start + len(rows[i])]
                torch.testing.assert_close(got, logits, atol=1e-5, rtol=0)
                for other in set(names) - {name}:  # the adapters give this row different logits
                    other_logits, _ = alone(model, other, lambda i=i, other=other: reference_row(
                        model, rows[i], prompt_lengths[i], second_pass_causal(other)))
                    assert (other_logits - logits).abs().max() > 1e-3
                loss_sum, supervised = loss_sum + row_loss, supervised + len(rows[i]) - prompt_lengths[i]
    # The loss of a mixed batch is that of one batch: every supervised token of every row, averaged over them all.
    torch.testing.assert_close(out.loss, loss_sum / supervised, atol=1e-5, rtol=0)
    with torch.no_grad():
        given = model(**batch, adapter_names=names, num_items_in_batch=7)
    torch.testing.assert_close(given.loss, loss_sum / 7, atol=1e-5, rtol=0)


def test_mixed_loss_with_a_prompt_mask_and_one_adapter_named_for_every_row_is_the_ordinary_loss(load_base):
    model = with_adapters(load_base("qwen2"), 2)
    _, batch, prompt_mask = padded_batch("right", VOCAB)
    batch["labels"] = batch["input_ids"].clone()  # labels everywhere: the prompt mask sets the boundary
    with torch.no_grad():
        plain = alone(model, "other", lambda: model(**batch, prompt_mask=prompt_mask))
        named = model(**batch, prompt_mask=prompt_mask, adapter_names=["other"] * 4)
    assert torch.equal(named.logits, plain.logits)
    torch.testing.assert_close(named.loss, plain.loss, **ROUNDING)


@pytest.mark.parametrize("count", [2, 3])
def test_multi_turn_forward_rows_equal_each_adapter_alone_and_the_alternating_reference(load_base, count):
    model = with_adapters(load_base("llama"), count)
    names = ROUTES[count]
    rows, batch = make_conversations("left")
    with torch.no_grad():
        out = model(**batch, adapter_names=names)
        loss_sum = 0.0
        for name, group in rows_by_adapter(names).items():
            own = alone(model, name, lambda group=group: model(**select(batch, group)))
            assert_as_alone(out.logits[group], own.logits)
            if not second_pass_causal(name):  # the alternating reference reads each instruction bidirectionally
                for i in group:
                    turns, trailing = ROWS[i]
                    row_loss, _ = alone(model, name, lambda i=i, turns=turns, trailing=trailing: reference_alternating(
                        model, rows[i], turns, trailing))
                    loss_sum = loss_sum + row_loss
            else:
                loss_sum = loss_sum + own.loss * int((batch["labels"][group] != -100).sum())
    total = int((batch["labels"] != -100).sum())
    torch.testing.assert_close(out.loss, loss_sum / total, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------- prefill, generate
def prompts(seed: int, lengths: list[int]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator) for n in lengths]


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_prefill_holds_each_rows_mix_by_its_adapter_and_decoding_from_it_continues_each_row(load_base, arch, count):
    model = with_adapters(load_base(arch), count)
    names = ROUTES[count]
    rows = prompts(7, [5, 11, 2, 8])
    batch = left_padded(rows)
    cache = model.base_model.prefill(**batch, adapter_names=names)
    assert cache.get_seq_length() == batch["input_ids"].shape[1] - 1
    for name, group in rows_by_adapter(names).items():
        for i in group:
            causal = second_pass_causal(name)
            expected = alone(model, name, lambda i=i: reference_prefill(model, rows[i][None], causal))
            for layer, ref_layer in zip(cache.layers, expected.layers):
                kept = ref_layer.keys.shape[-2]  # a sliding layer keeps only its window
                torch.testing.assert_close(layer.keys[i : i + 1, :, -kept:], ref_layer.keys, atol=1e-5, rtol=0)
                torch.testing.assert_close(layer.values[i : i + 1, :, -kept:], ref_layer.values, atol=1e-5, rtol=0)
    # Decoding steps by forward calls over the mixed cache: each row continues with its own causal weights.
    rest = torch.cat([batch["input_ids"][:, -1:], torch.randint(3, VOCAB, (4, 2))], dim=1)
    mask = torch.cat([batch["attention_mask"], torch.ones(4, 2, dtype=torch.long)], dim=1)
    with torch.no_grad():
        logits = model(input_ids=rest, attention_mask=mask, cache=cache, adapter_names=names,
                       position_ids=(mask.cumsum(1) - 1)[:, -3:]).logits
        assert cache.get_seq_length() == mask.shape[1]
        for name, group in rows_by_adapter(names).items():
            def own(group=group):
                group_cache = model.base_model.prefill(**select(batch, group))
                return model(input_ids=rest[group], attention_mask=mask[group], cache=group_cache,
                             position_ids=(mask[group].cumsum(1) - 1)[:, -3:]).logits
            assert_as_alone(logits[group], alone(model, name, own))


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_greedy_rows_equal_each_adapter_alone_and_the_reference(load_base, arch, count):
    model = with_adapters(load_base(arch), count)
    names = ROUTES[count]
    rows = prompts(3, [9, 1, 4, 12])
    batch = left_padded(rows)
    settings = dict(GREEDY, output_scores=True, return_dict_in_generate=True)
    mixed = model.generate(**batch, **settings, adapter_names=names)
    out = mixed.sequences
    width = batch["input_ids"].shape[1]
    for name, group in rows_by_adapter(names).items():
        own = alone(model, name, lambda group=group: model.generate(**select(batch, group), **settings))
        assert torch.equal(out[group], own.sequences)
        assert len(mixed.scores) == len(own.scores) == GREEDY["max_new_tokens"]
        for step, own_step in zip(mixed.scores, own.scores):
            assert_as_alone(step[group], own_step)
        for i in group:
            if not second_pass_causal(name):  # the greedy reference reads the prompt bidirectionally
                expected = alone(model, name, lambda i=i: reference_greedy(model, rows[i], GREEDY["max_new_tokens"]))
                assert out[i, width:].tolist() == expected
    everyone = {name: alone(model, name, lambda: model.generate(**batch, **GREEDY)) for name in set(names)}
    differs = [i for i, name in enumerate(names) if any(
        not torch.equal(everyone[name][i], everyone[other][i]) for other in set(names) - {name})]
    assert len(differs) >= 2  # wrong routing would show


def test_beam_search_and_several_return_sequences_rows_equal_each_adapter_alone(load_base):
    model = with_adapters(load_base("qwen2"), 3)
    names = ["other", "third", "default"]
    batch = left_padded(prompts(11, [3, 8, 6]))
    settings = dict(max_new_tokens=4, num_beams=3, num_return_sequences=2, do_sample=False, eos_token_id=None,
                    pad_token_id=0, return_dict_in_generate=True)
    out = model.generate(**batch, **settings, adapter_names=names)
    assert out.sequences.shape[0] == 6
    for name, group in rows_by_adapter(names).items():
        own = alone(model, name, lambda group=group: model.generate(**select(batch, group), **settings))
        returned = [2 * i + j for i in group for j in range(2)]
        assert torch.equal(out.sequences[returned], own.sequences)
        for layer, own_layer in zip(compat.output_cache(out).layers, compat.output_cache(own).layers):
            torch.testing.assert_close(layer.keys[returned], own_layer.keys, **ROUNDING)


@pytest.mark.parametrize("count", [2, 3])
def test_a_mixed_chat_goes_on_turn_after_turn_as_each_adapter_alone(load_base, count):
    """Two turns of `generate` and a `prefill` of a third instruction, each from the mixed cache of the turn before;
    every row as its adapter gives it alone, through the same turns."""
    model = with_adapters(load_base("llama"), count)
    names = ROUTES[count]
    batch = left_padded(prompts(5, [4, 9, 2, 6]))
    second = left_padded(prompts(6, [3, 1, 5, 2]))
    third = left_padded(prompts(8, [2, 4, 4, 3]))
    settings = dict(GREEDY, return_dict_in_generate=True)

    def chat(run_batch, names=None):
        extra = {} if names is None else {"adapter_names": names}
        out = model.generate(**run_batch(batch), **settings, **extra)
        cache = compat.output_cache(out)
        turn = {key: torch.cat([out.sequences if key == "input_ids" else cache.conversation_mask.long(), value], 1)
                for key, value in run_batch(second).items()}
        out2 = model.generate(**turn, cache=cache, **settings, **extra)
        assert compat.output_cache(out2) is cache  # extended in place
        turn3 = {key: torch.cat([out2.sequences if key == "input_ids" else cache.conversation_mask.long(), value], 1)
                 for key, value in run_batch(third).items()}
        model.base_model.prefill(**turn3, cache=cache, **extra)
        return out.sequences, out2.sequences, cache

    mixed = chat(lambda b: b, names)
    for name, group in rows_by_adapter(names).items():
        own = alone(model, name, lambda group=group: chat(lambda b: select(b, group)))
        assert torch.equal(mixed[0][group], own[0])
        assert torch.equal(mixed[1][group], own[1])
        assert mixed[2].get_seq_length() == own[2].get_seq_length()
        for layer, own_layer in zip(mixed[2].layers, own[2].layers):
            torch.testing.assert_close(layer.keys[group], own_layer.keys, **ROUNDING)
            torch.testing.assert_close(layer.values[group], own_layer.values, **ROUNDING)
        assert torch.equal(mixed[2].conversation_ids[group], own[2].conversation_ids)


def test_rows_that_stop_early_are_padded_and_fed_their_padding_as_generate_feeds_finished_rows(load_base):
    """One adapter's row meets its EOS token early: its sequence is padded with the pad token to the batch's width,
    and the cache goes on as decoding the row alone and then feeding it the padding by forward calls would. Per-step
    outputs are the batch's (one loop): each row's scores, up to its last step, as its adapter gives them alone."""
    model = with_adapters(load_base("llama"), 2)
    names = ["other", "default", "default"]
    batch = left_padded(prompts(11, [5, 5, 5]))  # equal lengths: forward calls then take the same positions
    free = model.generate(**batch, **GREEDY, adapter_names=names)[:, 5:]
    # The EOS token: one the `other` row gives first at its second or third step, and the `default` rows never.
    stop = next(k for k in (1, 2) if int(free[0, k]) not in free[0, :k].tolist() + free[1:].flatten().tolist())
    settings = dict(GREEDY, eos_token_id=int(free[0, stop]), pad_token_id=1, return_dict_in_generate=True)
    out = model.generate(**batch, **settings, adapter_names=names)
    assert out.sequences.shape[1] == 10
    assert out.sequences[0, 5:].tolist() == free[0, : stop + 1].tolist() + [1] * (4 - stop)
    scored = model.generate(**batch, **settings, output_scores=True, adapter_names=names)
    assert torch.equal(scored.sequences, out.sequences) and len(scored.scores) == 5
    for name, group in rows_by_adapter(names).items():
        own = alone(model, name, lambda group=group: model.generate(**select(batch, group), **settings,
                                                                   output_scores=True))
        assert len(own.scores) == (stop + 1 if name == "other" else 5)  # alone, the `other` row stops early
        for step, own_step in zip(scored.scores, own.scores):
            torch.testing.assert_close(step[group], own_step, **ROUNDING)

    def own():
        first = model.generate(**select(batch, [0]), **settings)
        cache = compat.output_cache(first)
        padded = torch.cat([first.sequences, torch.ones(1, 4 - stop, dtype=torch.long)], dim=1)
        with torch.no_grad():
            model(input_ids=padded[:, 5 + stop : 9], cache=cache)  # the last answer token, then the padding
        cache.record_conversation(padded, torch.ones_like(padded))
        return cache

    cache, own_cache = compat.output_cache(out), alone(model, "other", own)
    assert cache.get_seq_length() == own_cache.get_seq_length() == 9
    for layer, own_layer in zip(cache.layers, own_cache.layers):
        torch.testing.assert_close(layer.keys[:1], own_layer.keys, **ROUNDING)
    # The next turn, with the padding dropped from the attention, as for any batch whose rows ended early.
    new = torch.randint(3, VOCAB, (3, 3), generator=torch.Generator().manual_seed(4))
    mask = torch.cat([(out.sequences != 1).long(), torch.ones_like(new)], dim=1)
    conversation = torch.cat([out.sequences, new], dim=1)
    turn = model.generate(input_ids=conversation, attention_mask=mask, cache=cache, **settings, adapter_names=names)
    own_turn = alone(model, "other", lambda: model.generate(
        input_ids=conversation[:1], attention_mask=mask[:1], cache=own_cache, **settings))
    assert turn.sequences[0, : own_turn.sequences.shape[1]].tolist() == own_turn.sequences[0].tolist()


def test_rows_given_as_embeddings_are_split_with_their_rows(load_base):
    model = with_adapters(load_base("llama"), 3)
    names = ROUTES[3]
    embed = model.get_input_embeddings()
    _, batch, _ = padded_batch("left", VOCAB)
    prompt_batch = left_padded(prompts(9, [3, 6, 2, 5]))
    with torch.no_grad():
        embeds = embed(batch["input_ids"]) * 1.5  # not the ids' own embeddings, so that reading them shows
        prompt_embeds = embed(prompt_batch["input_ids"]) * 1.5
        logits = model(inputs_embeds=embeds, attention_mask=batch["attention_mask"], labels=batch["labels"],
                       adapter_names=names).logits
    out = model.generate(**prompt_batch, inputs_embeds=prompt_embeds, **GREEDY, adapter_names=names)
    for name, group in rows_by_adapter(names).items():
        with torch.no_grad():
            own = alone(model, name, lambda group=group: model(
                inputs_embeds=embeds[group], attention_mask=batch["attention_mask"][group],
                labels=batch["labels"][group]).logits)
        torch.testing.assert_close(logits[group], own, **ROUNDING)
        own_out = alone(model, name, lambda group=group: model.generate(
            **select(prompt_batch, group), inputs_embeds=prompt_embeds[group], **GREEDY))
        assert torch.equal(out[group], own_out)


# ------------------------------------------------------------------------------------------------------ __base__
def test_base_rows_are_the_base_model_reading_each_row_once_causally(load_base):
    """`"__base__"` rows, as PEFT names rows without an adapter: the base model's logits, loss terms and answers,
    beside rows of two adapters."""
    model = with_adapters(load_base("qwen2"), 2)
    names = ["__base__", "other", "default", "__base__"]
    rows, batch, _ = padded_batch("left", VOCAB)
    prompt_lengths = [1, 3, 7, 9]
    with torch.no_grad():
        out = model(**batch, adapter_names=names)
        loss_sum, supervised = 0.0, 0
        for i, (row, p) in enumerate(zip(rows, prompt_lengths)):
            if names[i] == "__base__":
                with model.disable_adapter():
                    logits = model(input_ids=row[None]).logits[0]
                start = int(batch["attention_mask"][i].argmax())
                torch.testing.assert_close(out.logits[i, start:], logits, atol=1e-5, rtol=0)
                row_loss = torch.nn.functional.cross_entropy(logits[p - 1 : -1], row[p:], reduction="sum")
            else:
                _, row_loss = alone(model, names[i], lambda i=i, p=p: reference_row(
                    model, rows[i], p, second_pass_causal(names[i])))
            loss_sum, supervised = loss_sum + row_loss, supervised + len(row) - p
    torch.testing.assert_close(out.loss, loss_sum / supervised, atol=1e-5, rtol=0)

    prompt_batch = left_padded(prompts(3, [9, 1, 4, 12]))
    settings = dict(GREEDY, output_scores=True, return_dict_in_generate=True)
    first = model.generate(**prompt_batch, **settings, adapter_names=names)
    base_rows = [0, 3]
    with model.disable_adapter():
        own = model.generate(**select(prompt_batch, base_rows), **settings)
    assert torch.equal(first.sequences[base_rows], own.sequences)
    for step, own_step in zip(first.scores, own.scores):
        torch.testing.assert_close(step[base_rows], own_step, atol=1e-5, rtol=0)
    for name in ("other", "default"):  # and the adapters' rows as they give them alone
        group = [names.index(name)]
        own = alone(model, name, lambda group=group: model.generate(**select(prompt_batch, group), **settings))
        assert torch.equal(first.sequences[group], own.sequences)
    # A mixed prefill holds the base rows' causal keys/values.
    prefilled = model.base_model.prefill(**prompt_batch, adapter_names=names)
    with model.disable_adapter(), torch.no_grad():
        row = prompts(3, [9, 1, 4, 12])[3]
        reference = model(input_ids=row[None, :-1], use_cache=True)
    for layer, own_layer in zip(prefilled.layers, compat.output_cache(reference).layers):
        torch.testing.assert_close(layer.keys[3:4], own_layer.keys, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------------- refusals, hooks
def test_bad_adapter_names_are_refused_in_one_line_before_any_compute(load_base):
    model = with_adapters(load_base("llama"), 2)
    rows, batch, _ = padded_batch("right", VOCAB)
    prompt_batch = left_padded(prompts(3, [2, 3, 4, 5]))
    cases = [
        (dict(adapter_names=["default", "nope", "other", "other"]), r"adapters \['nope'\] that this model does not"),
        (dict(adapter_names=["default", "other"]), "has 2 names for a batch of 4 rows"),
        (dict(adapter_names="other"), "one adapter name per row, got str"),
    ]
    for arguments, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            model(**batch, **arguments)
        with pytest.raises((ValueError, TypeError), match=message):
            model.generate(**prompt_batch, **GREEDY, **arguments)
        with pytest.raises((ValueError, TypeError), match=message):
            model.base_model.prefill(**prompt_batch, **arguments)
    names = ["default", "other", "other", "default"]
    with pytest.raises(ValueError, match="`fused_lm_head=True`"):
        model(**batch, adapter_names=names, fused_lm_head=True)
    model.train()
    with pytest.raises(ValueError, match="training mode"):
        model(**batch, adapter_names=names)


def test_adapter_names_apply_to_their_own_call_only(load_base):
    model = with_adapters(load_base("llama"), 2)
    batch = left_padded(prompts(3, [2, 3, 4, 5]))
    plain = model.generate(**batch, **GREEDY)
    with pytest.raises(ValueError, match="does not have"):
        model.generate(**batch, **GREEDY, adapter_names=["x"] * 4)
    model.generate(**batch, **GREEDY, adapter_names=["other"] * 4)
    assert torch.equal(model.generate(**batch, **GREEDY), plain)
    assert model.base_model.active_adapter == "default"
    with model.disable_adapter():  # the base model for every row, as in PEFT
        base = model.generate(**batch, **GREEDY, adapter_names=["other"] * 4)
        assert torch.equal(base, model.generate(**batch, **GREEDY))
    assert not torch.equal(base, plain)


def test_peft_hands_adapter_names_to_the_tuners_forward_hook(load_base, monkeypatch):
    """A private interface: `PeftModel.forward` and `generate` drop `adapter_names` before calling the tuner, and hand
    them to the tuner's `_enable_peft_forward_hooks` only. If PEFT changes that, the names would be lost silently."""
    model = with_adapters(load_base("llama"), 2)
    tuner_class = type(model.base_model)
    hook, seen = tuner_class._enable_peft_forward_hooks, []

    def recording(self, *args, **kwargs):
        seen.append(kwargs.get("adapter_names"))
        return hook(self, *args, **kwargs)

    monkeypatch.setattr(tuner_class, "_enable_peft_forward_hooks", recording)
    names = ["other", "default", "other", "default"]
    _, batch, _ = padded_batch("right", VOCAB)
    with torch.no_grad():
        model(**batch, adapter_names=names)
    model.generate(**left_padded(prompts(3, [2, 3, 4, 5])), **GREEDY, adapter_names=names)
    assert seen == [names, names], (
        "PEFT no longer hands `adapter_names` to the tuner's `_enable_peft_forward_hooks` in `PeftModel.forward` and "
        "`generate`: find where it goes now and take it there (BituneModel._enable_peft_forward_hooks)."
    )


# --------------------------------------------------------------------------------------- one batch, one loop
class RecordingStreamer(BaseStreamer):
    """A streamer of any batch size that keeps what `generate` hands it, and checks at every step that the call
    switches no adapter: the tuner's active adapter and every layer's routing stay as they were."""

    def __init__(self, model) -> None:
        self.model, self.values = model, []
        self.routing = [list(layer.active_adapters) for layer in model.base_model._router.index.tuner_layers]

    def put(self, value: torch.Tensor) -> None:
        assert self.model.base_model.active_adapter == "default"
        assert [list(layer.active_adapters) for layer in self.model.base_model._router.index.tuner_layers] == \
            self.routing
        self.values.append(value)

    def end(self) -> None:
        pass


def test_a_streamer_and_prefix_allowed_tokens_fn_follow_the_whole_mixed_batch(load_base):
    """Refused while the batch was split by adapter; now one `generate` loop: the streamer sees every row at every
    step, and `prefix_allowed_tokens_fn`'s `batch_id` numbers the batch's rows."""
    model = with_adapters(load_base("llama"), 3)
    names = ROUTES[3]
    batch = left_padded(prompts(3, [9, 1, 4, 12]))
    streamer = RecordingStreamer(model)
    out = model.generate(**batch, **GREEDY, streamer=streamer, adapter_names=names)
    assert torch.equal(streamer.values[0], batch["input_ids"])
    assert torch.equal(torch.stack(streamer.values[1:], dim=1), out[:, batch["input_ids"].shape[1]:])
    assert torch.equal(out, model.generate(**batch, **GREEDY, adapter_names=names))

    def allowed(batch_id, ids):  # row i may only say i + 3 or i + 10: rows numbered within a group would show
        return [batch_id + 3, batch_id + 10]

    constrained = model.generate(**batch, **GREEDY, prefix_allowed_tokens_fn=allowed, adapter_names=names)
    width = batch["input_ids"].shape[1]
    for name, group in rows_by_adapter(names).items():
        def own_allowed(batch_id, ids, group=group):
            return allowed(group[batch_id], ids)
        own = alone(model, name, lambda group=group, own_allowed=own_allowed: model.generate(
            **select(batch, group), **GREEDY, prefix_allowed_tokens_fn=own_allowed))
        assert torch.equal(constrained[group], own)
    for i in range(4):
        assert set(constrained[i, width:].tolist()) <= {i + 3, i + 10}


def test_sampling_draws_as_one_batch(load_base):
    """A mixed batch samples in one loop: with the same seed, each row draws what it draws when the whole batch is
    sampled with its adapter alone (the same random numbers for the same rows), and several return sequences per
    prompt take a name per prompt or per returned sequence, as LoRA takes them."""
    model = with_adapters(load_base("llama"), 2)
    names = ["other", "default", "default"]
    batch = left_padded(prompts(4, [5, 8, 3]))
    settings = dict(max_new_tokens=6, do_sample=True, top_k=0, eos_token_id=None, pad_token_id=0,
                    num_return_sequences=2)
    torch.manual_seed(11)
    mixed = model.generate(**batch, **settings, adapter_names=names)
    for name, group in rows_by_adapter(names).items():
        torch.manual_seed(11)
        same = alone(model, name, lambda: model.generate(**batch, **settings))
        returned = [2 * i + j for i in group for j in range(2)]
        assert torch.equal(mixed[returned], same[returned])
    torch.manual_seed(11)
    per_output_row = model.generate(**batch, **settings, adapter_names=[n for n in names for _ in range(2)])
    assert torch.equal(per_output_row, mixed)
    with pytest.raises(ValueError, match="different adapters for the return sequences of one prompt"):
        model.generate(**batch, **settings, adapter_names=["other", "default"] * 3)
    with pytest.raises(ValueError, match=r"has 4 names for a batch of 3 rows.*\(or 6, one per returned sequence\)"):
        model.generate(**batch, **settings, adapter_names=["other"] * 4)


def test_beam_indices_number_the_batchs_rows(load_base):
    """Issue 62, item 6: with the batch split by adapter, `beam_indices` numbered each group's beams from 0, so
    `compute_transition_scores` read other rows' scores. One loop numbers the batch's beams."""
    model = with_adapters(load_base("qwen2"), 2)
    names = ["other", "default", "other"]
    batch = left_padded(prompts(12, [4, 7, 5]))
    settings = dict(max_new_tokens=4, num_beams=3, num_return_sequences=2, do_sample=False, eos_token_id=None,
                    pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    out = model.generate(**batch, **settings, adapter_names=names)
    steps = out.beam_indices[:, :4]
    rows = torch.arange(6)[:, None] // 2
    assert ((steps // 3) == rows).all()  # every returned sequence's beams are its own prompt's
    transition = model.compute_transition_scores(out.sequences, out.scores, out.beam_indices)
    for name, group in rows_by_adapter(names).items():
        own = alone(model, name, lambda group=group: model.generate(**select(batch, group), **settings))
        own_transition = model.compute_transition_scores(own.sequences, own.scores, own.beam_indices)
        returned = [2 * i + j for i in group for j in range(2)]
        torch.testing.assert_close(transition[returned], own_transition, atol=1e-5, rtol=0)
        torch.testing.assert_close(out.sequences_scores[returned], own.sequences_scores, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------ __base__ and caches
def test_base_rows_cannot_continue_a_bitune_cache_as_inside_disable_adapter(load_base):
    """Issue 62, item 9: a `"__base__"` row runs the base model, which inside `disable_adapter()` cannot continue a
    Bitune cache (mixed keys/values); a mixed batch refused it for no row. Both are refused alike, before any work."""
    model = with_adapters(load_base("llama"), 2)
    names = ["other", "__base__"]
    batch = left_padded(prompts(2, [4, 6]))
    first = model.generate(**batch, **GREEDY, return_dict_in_generate=True, adapter_names=["other", "default"])
    cache = compat.output_cache(first)
    new = left_padded(prompts(3, [2, 3]))
    turn = {"input_ids": torch.cat([first.sequences, new["input_ids"]], dim=1),
            "attention_mask": torch.cat([cache.conversation_mask.long(), new["attention_mask"]], dim=1)}
    length = cache.get_seq_length()
    message = "'__base__' rows run the base model, which cannot continue a Bitune cache"
    with pytest.raises(ValueError, match="cannot be used with the adapters disabled"), model.disable_adapter():
        model.generate(**turn, cache=cache, **GREEDY)
    with pytest.raises(ValueError, match=message):
        model.generate(**turn, cache=cache, **GREEDY, adapter_names=names)
    with pytest.raises(ValueError, match=message):
        model.base_model.prefill(**turn, cache=cache, adapter_names=names)
    with pytest.raises(ValueError, match=message), torch.no_grad():
        model(input_ids=turn["input_ids"][:, -1:], attention_mask=turn["attention_mask"], cache=cache,
              adapter_names=names)
    assert cache.get_seq_length() == length  # nothing was read


def test_base_rows_first_step_outputs_are_the_base_models(load_base):
    """Issue 62, item 11: `"__base__"` rows' first-step attentions and hidden states covered the last prompt token
    only. A batch of `"__base__"` rows is the base model's `generate`: the same shapes and values as under
    `disable_adapter()`. Beside Bitune rows, whose first step reads the mixed cache with one query, the batch's first
    step has one query per row: a base row's is the last row of what `disable_adapter()` gives."""
    model = with_adapters(load_base("llama"), 2)
    batch = left_padded(prompts(5, [6, 9]))
    settings = dict(GREEDY, return_dict_in_generate=True, output_attentions=True, output_hidden_states=True,
                    output_scores=True)
    with model.disable_adapter():
        base = model.generate(**batch, **settings)
    only_base = model.generate(**batch, **settings, adapter_names=["__base__", "__base__"])
    assert torch.equal(only_base.sequences, base.sequences)
    for ours, theirs in zip(only_base.attentions[0] + only_base.hidden_states[0],
                            base.attentions[0] + base.hidden_states[0]):
        assert ours.shape == theirs.shape and ours.shape[-2] == batch["input_ids"].shape[1]
        torch.testing.assert_close(ours, theirs, **ROUNDING)
    mixed = model.generate(**batch, **settings, adapter_names=["other", "__base__"])
    for ours, theirs in zip(mixed.attentions[0], base.attentions[0]):
        assert ours.shape[-2] == 1
        torch.testing.assert_close(ours[1, :, -1], theirs[1, :, -1], **ROUNDING)
    for ours, theirs in zip(mixed.hidden_states[0], base.hidden_states[0]):
        torch.testing.assert_close(ours[1, -1], theirs[1, -1], atol=1e-5, rtol=0)
    assert torch.equal(mixed.sequences[1], base.sequences[1])


# ------------------------------------------------------------------------------------------------------ fallback
def test_adapters_that_lay_out_turns_differently_run_one_forward_each(load_base):
    """The one difference a batch cannot express: `multi_turn="history"` re-reads every turn's history, the
    alternating way carries one cache. Such a batch runs one forward per setting; every row and the loss as each
    adapter gives them alone."""
    model = with_adapters(load_base("llama"), 2)
    torch.manual_seed(5)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    model.add_adapter("history", BituneConfig(adapter_config=lora, multi_turn="history"))
    model.set_adapter("default")
    model.eval()
    names = ["history", "default", "other", "history"]
    rows, batch = make_conversations("left")
    with torch.no_grad():
        out = model(**batch, adapter_names=names)
        loss_sum = 0.0
        for name, group in rows_by_adapter(names).items():
            own = alone(model, name, lambda group=group: model(**select(batch, group)))
            torch.testing.assert_close(out.logits[group], own.logits, **ROUNDING)
            loss_sum = loss_sum + own.loss * int((batch["labels"][group] != -100).sum())
        history = alone(model, "history", lambda: model(**batch))
        alternating = alone(model, "default", lambda: model(**batch))
    assert (history.logits[0] - alternating.logits[0]).abs().max() > 1e-3  # the layouts differ on these rows
    torch.testing.assert_close(out.loss, loss_sum / int((batch["labels"] != -100).sum()), atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ["ia3", "dora"])
def test_an_inner_method_without_per_row_adapters_runs_its_layers_again_for_each_adapters_rows(load_base, method):
    """IA3 layers have no per-row mechanism, and LoRA's refuses DoRA: such layers run once more for each adapter's
    rows, routed to that adapter alone; the batch stays one batch, and every row is as its adapter gives it alone."""
    def inner():
        if method == "ia3":
            return IA3Config(target_modules=["q_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
                             init_ia3_weights=False)
        return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, use_dora=True)

    model = make_bitune(load_base("llama"), adapter_config=inner())
    torch.manual_seed(3)
    model.add_adapter("other", BituneConfig(adapter_config=inner(), second_pass_attention="causal"))
    model.set_adapter("default")
    model.eval()
    names = ["other", "__base__", "default", "other"]
    batch = left_padded(prompts(3, [2, 5, 3, 4]))
    settings = dict(GREEDY, return_dict_in_generate=True, output_scores=True)
    out = model.generate(**batch, **settings, adapter_names=names)
    rows, forward_batch, _ = padded_batch("left", VOCAB)
    with torch.no_grad():
        logits = model(**forward_batch, adapter_names=names).logits
    for name, group in rows_by_adapter(names).items():
        if name == "__base__":
            with model.disable_adapter():
                own = model.generate(**select(batch, group), **settings)
        else:
            own = alone(model, name, lambda group=group: model.generate(**select(batch, group), **settings))
            with torch.no_grad():
                own_logits = alone(model, name, lambda group=group: model(**select(forward_batch, group)).logits)
            assert_as_alone(logits[group], own_logits)
        assert torch.equal(out.sequences[group], own.sequences)
        for step, own_step in zip(out.scores, own.scores):
            assert_as_alone(step[group], own_step)
