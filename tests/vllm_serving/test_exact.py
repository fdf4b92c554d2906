"""Bitune on vLLM gives `generate`'s answers: per family, 8 prompts of different lengths submitted together (steps mix
fresh prefills and decoding), greedy tokens equal and log-probabilities within 1e-4 (float32 on CPU: the two differ
only in the order of float32 sums, ~1e-6 measured)."""

from __future__ import annotations

import gc

import pytest
from helpers import engine_kwargs, generate_reference, prompts, save_adapter, save_base, vllm_answers

from vllm_integration import load_llm

LOG_PROB_TOLERANCE = 1e-4
# Qwen2 mixes its first layer only (`mixed_layers`): the other keeps the causal cache.
FAMILIES = {"llama": None, "mistral": None, "qwen2": [0], "qwen3": None, "gemma3": None}


def close_engine(llm) -> None:
    del llm
    gc.collect()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_and_log_probs_equal_generate(tmp_path, family):
    base = save_base(family, str(tmp_path / "base"))
    adapter = save_adapter(base, str(tmp_path / "adapter"), mixed_layers=FAMILIES[family])
    rows = prompts()
    expected = generate_reference(base, adapter, rows)
    llm = load_llm(adapter, **engine_kwargs())
    answers = vllm_answers(llm, rows)
    close_engine(llm)
    for row, (tokens, log_probs), (got_tokens, got_log_probs, _) in zip(rows, expected, answers):
        assert got_tokens == tokens, f"prompt of {len(row)} tokens"
        assert max(abs(a - b) for a, b in zip(got_log_probs, log_probs)) <= LOG_PROB_TOLERANCE


def test_negative_control_bidirectional_weights_change_the_answer(tmp_path):
    """The same adapter with its bidirectional weight set zeroed gives other tokens (and still `generate`'s own), so
    the tests above see the bidirectional pass through the cache. The engine also refuses a multi-turn chat."""
    base = save_base("llama", str(tmp_path / "base"))
    adapter = save_adapter(base, str(tmp_path / "adapter"))
    zeroed = save_adapter(base, str(tmp_path / "zeroed"), zero_bidirectional=True)
    rows = prompts()
    with_bidirectional = generate_reference(base, adapter, rows)
    expected = generate_reference(base, zeroed, rows)
    llm = load_llm(zeroed, **engine_kwargs())
    answers = vllm_answers(llm, rows)
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    with pytest.raises(ValueError, match="2 user turns"):
        llm.chat(chat)
    close_engine(llm)
    assert [tokens for tokens, _, _ in answers] == [tokens for tokens, _ in expected]
    differ = sum(got != tokens for (got, _, _), (tokens, _) in zip(answers, with_bidirectional))
    assert differ >= 4, f"only {differ} of 8 answers changed without the bidirectional weights"


def test_preempted_request_is_exact_or_fails_clearly(tmp_path):
    """A cache of a few blocks preempts requests: each answer either equals `generate`'s or stops with
    finish_reason 'error' (it would be resumed by reading its answer as prompt); some are preempted."""
    base = save_base("llama", str(tmp_path / "base"))
    adapter = save_adapter(base, str(tmp_path / "adapter"))
    rows = prompts()
    new_tokens = 20
    expected = generate_reference(base, adapter, rows, new_tokens)
    llm = load_llm(adapter, **engine_kwargs(block_size=32, num_gpu_blocks_override=3, max_model_len=48))
    answers = vllm_answers(llm, rows, max_tokens=new_tokens)
    close_engine(llm)
    failed = [i for i, (_, _, finish) in enumerate(answers) if finish == "error"]
    assert failed, "no request was preempted: the test's cache is too large to test preemption"
    for i, ((got, _, finish), (tokens, _)) in enumerate(zip(answers, expected)):
        if finish != "error":
            assert got == tokens, f"prompt {i} finished ({finish}) with other tokens than generate"
        else:
            assert got == tokens[: len(got)], f"prompt {i} failed after tokens that differ from generate"
