"""Tiny random bases of each family the plugin serves, perturbed Bitune adapters on them, and `generate`'s answers.

The families are those of tests/tiny_models.py, with heads of 32 dimensions (vLLM's CPU attention kernel takes no
smaller head) and two layers; the adapters have both weight sets and the mixing scalars moved away from their
initial values, so that every part of the adapter changes the answer.
"""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

import peft_bitune  # noqa: F401  (registers the BITUNE peft type)
from peft_bitune import BituneConfig

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)
# Different lengths, some over the sliding window (6) and one of a single token (nothing to read twice).
PROMPT_LENGTHS = [9, 1, 4, 12, 20, 2, 7, 15]
NEW_TOKENS = 6


def family_config(family: str):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama": lambda: LlamaConfig(**COMMON),
        "mistral": lambda: MistralConfig(sliding_window=6, **COMMON),
        "qwen2": lambda: Qwen2Config(**COMMON),
        "qwen3": lambda: Qwen3Config(**COMMON),
        "gemma3": lambda: Gemma3TextConfig(sliding_window=6, layer_types=["sliding_attention", "full_attention"],
                                           **COMMON),
    }[family]()


def save_base(family: str, folder: str) -> str:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(family_config(family)).save_pretrained(folder)
    return folder


def save_adapter(base_folder: str, folder: str, mixed_layers: list[int] | None = None, seed: int = 1,
                 zero_bidirectional: bool = False) -> str:
    """A Bitune adapter whose LoRA weights (both sets) and mixing scalars are perturbed, as training would; with
    `zero_bidirectional`, the bidirectional set's LoRA is zeroed (the prompt's second pass runs the base weights)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_folder)
    config = BituneConfig(adapter_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
                          mixed_layers=mixed_layers)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.add_(torch.randn_like(parameter) * 0.3)
                if zero_bidirectional and "__bidirectional" in name:
                    parameter.zero_()
            elif "bitune_mixers" in name:
                parameter.add_(torch.randn_like(parameter) * 0.02)
    model.save_pretrained(folder)
    return folder


def prompts(seed: int = 3) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def generate_reference(base_folder: str, adapter_folder: str, rows: list[list[int]], new_tokens: int = NEW_TOKENS):
    """The project's `generate` on all prompts in one left-padded batch: per prompt, (tokens, log-probabilities)."""
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_folder), adapter_folder).eval()
    width = max(map(len, rows))
    input_ids = torch.tensor([[0] * (width - len(row)) + row for row in rows])
    attention_mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows])
    output = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                            do_sample=False, eos_token_id=None, pad_token_id=0, output_scores=True,
                            return_dict_in_generate=True)
    tokens = output.sequences[:, width:]
    log_probs = torch.stack([torch.log_softmax(step.float(), dim=-1) for step in output.scores], dim=1)
    chosen = log_probs.gather(-1, tokens[..., None])[..., 0]
    return [(tokens[i].tolist(), chosen[i].tolist()) for i in range(len(rows))]


def vllm_answers(llm, rows: list[list[int]], max_tokens: int = NEW_TOKENS):
    """vLLM's greedy answers to all prompts submitted together: per prompt, (tokens, log-probabilities, finish)."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0, ignore_eos=True, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=row) for row in rows], params, use_tqdm=False)
    answers = []
    for output in outputs:
        completion = output.outputs[0]
        tokens = list(completion.token_ids)
        log_probs = [step[token].logprob for step, token in zip(completion.logprobs or [], tokens)]
        answers.append((tokens, log_probs, completion.finish_reason))
    return answers


def engine_kwargs(**extra):
    """The engine settings of the tests: float32, short contexts, no tokenizer (the tiny bases have none)."""
    return {"dtype": "float32", "max_model_len": 64, "seed": 0, "skip_tokenizer_init": True, **extra}
