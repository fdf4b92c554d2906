"""The lm-evaluation-harness model `bitune`: log-likelihoods and generation with Bitune's prefill of the instruction.

Importing this module registers the model (it needs the `lm-eval` package: `pip install peft-bitune[eval]`). The
harness finds no plugins by itself, so use `bitune-eval` (same arguments as `lm_eval`) on the command line, or import
this module before calling `lm_eval.simple_evaluate(model="bitune", ...)`.

What each request type means for a Bitune adapter:

- `loglikelihood(context, continuation)`: the context is the instruction. Its tokens except the last are read twice
  (bidirectional and causal weights) and the two caches are mixed; the last context token and the continuation then
  run causally with the causal weights over the mixed cache, so the logits at the last context token predict the first
  continuation token. This is the training forward's score of the continuation as the answer. Each distinct context
  is prefilled once per evaluation, however many continuations (choices) it has, and both steps are batched.
- `generate_until`: Bitune's `generate` (prefill twice, mix, decode with the causal weights), batched with left
  padding, stopping at the harness's stop sequences.
- `loglikelihood_rolling` (perplexity tasks): a document is the answer to an empty instruction, so nothing is read
  bidirectionally: every token is scored causally with the causal weights, in the harness's rolling windows.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from lm_eval import utils as harness_utils
from lm_eval.api.instance import Instance
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import Collator
from peft import PeftConfig, PeftModel
from torch.nn import functional as F
from tqdm import tqdm
from transformers.cache_utils import Cache, DynamicCache

from .. import compat
from ..constants import CAUSAL, is_bitune_type, peft_type_name
from ..tuner.checks import positions_for
from ..tuner.find_tuner import require_bitune_tuner

logger = logging.getLogger(__name__)

# One loglikelihood request as the harness hands it over: ((context, continuation) strings, context ids, continuation
# ids). The strings are `None` for the windows of a rolling request.
TokenRequest = tuple[tuple[str, str] | None, list[int], list[int]]


class PrefillOnceLM(HFLM):
    """
    The harness's Hugging Face model (`hf`), with log-likelihoods computed from one prefill per distinct context.

    Each context minus its last token is prefilled once into a key/value cache; then its last token and each
    continuation run over that cache, and the LM head is applied only where a continuation token is scored. The
    scores equal `hf`'s (the tests compare them); a multiple-choice task costs one context read per question instead
    of one per choice, which matters for large vocabularies and long questions (MMLU). `BituneLM` is this with Bitune's
    prefill; for a plain model (the base, a LoRA adapter) the prefill is an ordinary causal forward, so both are scored
    by the same code. Generation and rolling log-likelihoods are `hf`'s.

    Args:
        pretrained (`str` or `PreTrainedModel`): as for `hf`.
        **kwargs: every other argument of the harness's `hf` model. `batch_size` (an integer, defaults to 1) is the
            number of contexts per prefill and of continuations per answer pass.
    """

    def __init__(self, pretrained: Any, **kwargs: Any) -> None:
        _check_batch_size(kwargs)
        super().__init__(pretrained=pretrained, **kwargs)

    # ------------------------------------------------------------------ loglikelihood
    def _loglikelihood_tokens(
        self, requests: list[TokenRequest], disable_tqdm: bool = False, override_bs: int | None = None
    ) -> list[tuple[float, bool]]:
        """Score each continuation as the answer to its context: one prefill per distinct context, then batches."""
        pairs = [self._fit_to_max_length(context, continuation) for _, context, continuation in requests]
        # Grouped by the whole context: its one prefill serves all its continuations. (HFLM groups by context +
        # continuation[:-1], which shares a forward only between one-token continuations; the cache does more here.)
        by_context = Collator.group(enumerate(pairs), fn=lambda item: item[1][0], group_by="contexts")

        def longest_first(group: tuple[tuple[int, ...], list]) -> tuple[int, tuple[int, ...]]:
            # The first batches are the largest, so running out of memory shows at once.
            context, members = group
            return -len(context) - max(len(continuation) for _, (_, continuation) in members), context

        ordered = Collator(list(by_context.items()), sort_fn=longest_first)
        batch_size = override_bs or self.batch_size

        results: list[tuple[float, bool] | None] = [None] * len(requests)
        progress = tqdm(total=len(requests), disable=disable_tqdm or self.rank != 0, desc="Bitune loglikelihood")
        for chunk in ordered.get_batched(n=batch_size):
            with self._inference():
                cache, prefix_mask = self._prefill([list(context) for context, _ in chunk])
            rows = [(row, index) for row, (_, members) in enumerate(chunk) for index, _ in members]
            for start in range(0, len(rows), batch_size):
                batch = rows[start : start + batch_size]
                with self._inference():
                    scores = self._score_continuations(
                        cache, prefix_mask, [row for row, _ in batch], [pairs[index] for _, index in batch]
                    )
                for (_, index), score in zip(batch, scores):
                    results[index] = score
                    strings = requests[index][0]
                    if strings is not None:
                        self.cache_hook.add_partial("loglikelihood", strings, score)
                progress.update(len(batch))
        progress.close()
        return results

    def _fit_to_max_length(self, context: list[int], continuation: list[int]) -> tuple[list[int], list[int]]:
        """Left-truncate the context (with a warning, like `hf`) so that prefix and answer fit in `max_length`."""
        if not context:
            raise ValueError("A loglikelihood request has an empty context; the harness puts a prefix token there.")
        if not continuation:
            raise ValueError("A loglikelihood request has an empty continuation: there is nothing to score.")
        if len(continuation) > self.max_length:
            raise ValueError(
                f"A continuation has {len(continuation)} tokens, more than `max_length` ({self.max_length}); it "
                "cannot be scored. Raise `max_length` if the model supports longer sequences."
            )
        # Positions used: context[:-1] in the prefill, then context[-1] and continuation[:-1] in the answer pass.
        overflow = len(context) + len(continuation) - 1 - self.max_length
        if overflow > 0:
            logger.warning(
                "Context (%d tokens) and continuation (%d tokens) exceed `max_length` (%d): the first %d context "
                "tokens are dropped.", len(context), len(continuation), self.max_length, overflow
            )
            context = context[overflow:]
        return context, continuation

    def _prefill(self, contexts: list[list[int]]) -> tuple[Cache, torch.Tensor]:
        """A causal prefill of left-padded contexts: the cache of each context minus its last token."""
        input_ids, attention_mask = self._pad(contexts, side="left")
        prompt_ids, prompt_mask = input_ids[:, :-1], attention_mask[:, :-1]
        cache = DynamicCache(config=self.model.config)
        if prompt_ids.shape[1] > 0:
            self.model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions_for(prompt_mask),
                       **compat.with_cache(self.model, cache), use_cache=True, logits_to_keep=1)
        return cache, prompt_mask

    def _answer_model(self) -> torch.nn.Module:
        """The model that continues the prefilled cache."""
        return self.model

    def _answer_weights(self) -> AbstractContextManager:
        """The weights the continuation runs with (the model as it is)."""
        return nullcontext()

    def _score_continuations(
        self,
        cache: Cache,
        prefix_mask: torch.Tensor,
        cache_rows: list[int],
        pairs: list[tuple[list[int], list[int]]],
    ) -> list[tuple[float, bool]]:
        """
        The answer pass for a batch of continuations, each over row `cache_rows[i]` of the prefilled cache.

        Input i is its context's last token then its continuation but the last token, right-padded; its logits at
        position j predict continuation[j].
        """
        rows = torch.tensor(cache_rows)  # on the CPU: it indexes cache layers that may sit on several devices
        input_ids, answer_mask = self._pad([[context[-1], *continuation[:-1]] for context, continuation in pairs],
                                           side="right")
        row_prefix_mask = prefix_mask.index_select(0, rows.to(prefix_mask.device))
        # The cache holds positions 0..P-2 of each row (left-padded); the answer pass continues at P-1.
        position_ids = row_prefix_mask.sum(dim=1, keepdim=True) + torch.arange(input_ids.shape[1], device=self.device)
        # A plain causal continuation of the cache (for Bitune with the causal weights), as a decoding step would be.
        model = self._answer_model()
        with self._answer_weights():
            logits = model(
                input_ids=input_ids,
                attention_mask=torch.cat([row_prefix_mask, answer_mask], dim=1),
                position_ids=position_ids * answer_mask,  # padding at 0: never past the model's last position
                **compat.with_cache(model, _select_rows(cache, rows)),
                use_cache=True,
            ).logits
        return [self._continuation_score(logits[i, : len(continuation)], continuation)
                for i, (_, continuation) in enumerate(pairs)]

    def _continuation_score(self, logits: torch.Tensor, continuation: list[int]) -> tuple[float, bool]:
        """(summed log-probability of `continuation`, whether greedy decoding gives it) from its (C, vocab) logits."""
        logprobs = F.log_softmax(logits, dim=-1, dtype=self.softmax_dtype or torch.float32)
        targets = torch.tensor(continuation, device=logits.device)
        total = logprobs.gather(1, targets[:, None]).sum()
        return float(total), bool((logprobs.argmax(dim=-1) == targets).all())

    # ------------------------------------------------------------------ helpers
    @contextmanager
    def _inference(self) -> Iterator[None]:
        with torch.no_grad(), torch.autocast(
            device_type=self.device.type,
            dtype=self.mixed_precision_dtype,
            enabled=self.mixed_precision_dtype is not None,
        ):
            yield

    def _pad(self, sequences: Sequence[list[int]], side: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Token lists -> (input_ids, attention_mask), padded on `side` by the tokenizer (the harness sets its pad
        token)."""
        batch = self.tokenizer.pad(
            {"input_ids": list(sequences)}, padding=True, padding_side=side, return_tensors="pt",
            return_attention_mask=True,
        )
        return batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)



@register_model("bitune")
class BituneLM(PrefillOnceLM):
    """
    The harness's Hugging Face model (`hf`) for a Bitune adapter: same arguments, Bitune scoring and generation.

    Args:
        pretrained (`str` or `PeftModel`): the base model (name or path, with `peft=` the adapter), or an already
            built Bitune `PeftModel` (then pass `tokenizer=` too).
        peft (`str`, *optional*): the Bitune adapter (path or Hub name), loaded with `PeftModel.from_pretrained`.
        **kwargs: every other argument of the harness's `hf` model (`dtype`, `device`, `max_length`, `tokenizer`,
            `softmax_dtype`, ...). Log-probabilities are computed in float32 unless `softmax_dtype` says otherwise.
            `batch_size` (defaults to 1) is the number of rows per forward: contexts per prefill and continuations per
            answer pass (log-likelihood), prompts per `generate` call (generation); `"auto"` is not supported.

    Example:
        >>> import peft_bitune.evaluation.harness  # registers "bitune"
        >>> lm_eval.simple_evaluate(model="bitune", model_args="pretrained=BASE,peft=ADAPTER", tasks=["piqa"])
    """

    def __init__(self, pretrained: str | PeftModel, peft: str | None = None, **kwargs: Any) -> None:
        _check_arguments(pretrained, peft, kwargs)
        kwargs.pop("backend", None)
        super().__init__(pretrained=pretrained, peft=peft, backend="causal", **kwargs)
        self._bitune = require_bitune_tuner(
            self.model, "for the harness's `bitune` model", "For other adapters use the harness's `hf` model."
        )

    # ------------------------------------------------------------------ loglikelihood
    def _prefill(self, contexts: list[list[int]]) -> tuple[Cache, torch.Tensor]:
        """Bitune's prefill of left-padded contexts: the mixed cache of each context minus its last token."""
        input_ids, attention_mask = self._pad(contexts, side="left")
        cache = self._bitune.prefill(input_ids, attention_mask)
        return cache, attention_mask[:, :-1]

    def _answer_model(self) -> torch.nn.Module:
        return self._bitune.model

    def _answer_weights(self) -> AbstractContextManager:
        return self._bitune.weights(CAUSAL)

    # ------------------------------------------------------------------ rolling loglikelihood
    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """
        Log-likelihood of whole documents (perplexity tasks), in the harness's rolling windows of `max_length`.

        A document is the answer to an empty instruction, so Bitune reads nothing bidirectionally: every window is
        scored causally with the causal weights (its context tokens, from the previous window, are answer tokens too).
        """
        windows: list[tuple[list[int], list[int]]] = []
        owners: list[int] = []
        for index, (text,) in enumerate(request.args for request in requests):
            token_windows = harness_utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1,
            )
            for window in map(harness_utils.make_disjoint_window, token_windows):
                windows.append(window)
                owners.append(index)
        totals = [0.0] * len(requests)
        for start in tqdm(range(0, len(windows), self.batch_size), disable=disable_tqdm or self.rank != 0,
                          desc="Bitune loglikelihood_rolling"):
            batch = windows[start : start + self.batch_size]
            with self._inference():
                scores = self._score_causally(batch)
            for owner, score in zip(owners[start : start + self.batch_size], scores):
                totals[owner] += score
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def _score_causally(self, windows: list[tuple[list[int], list[int]]]) -> list[float]:
        input_ids, attention_mask = self._pad([context + continuation[:-1] for context, continuation in windows],
                                              side="right")
        with self._bitune.weights(CAUSAL):
            logits = self._bitune.model(input_ids=input_ids, attention_mask=attention_mask).logits
        scores = []
        for i, (context, continuation) in enumerate(windows):
            start = len(context) - 1
            scores.append(self._continuation_score(logits[i, start : start + len(continuation)], continuation)[0])
        return scores

def _check_arguments(pretrained: Any, peft: str | None, kwargs: dict[str, Any]) -> None:
    """Refuse, before anything is loaded, arguments the `bitune` model cannot honour."""
    if isinstance(pretrained, str) and not peft:
        raise ValueError(
            "The `bitune` model evaluates a Bitune adapter: pass it as `peft=PATH_OR_NAME` next to "
            "`pretrained=BASE_MODEL` (for a model without a Bitune adapter use `--model hf`)."
        )
    if not isinstance(pretrained, str) and peft:
        raise ValueError("`peft=` loads an adapter onto a base model given by name; `pretrained` is already a model.")
    _check_batch_size(kwargs)
    if kwargs.get("backend", "default") not in ("default", "causal"):
        raise ValueError(f"Bitune adapters are for decoder-only models; `backend={kwargs['backend']!r}` is not one.")
    if kwargs.get("delta"):
        raise ValueError("`delta=` weights cannot be combined with a Bitune adapter; pass only `peft=`.")
    if isinstance(pretrained, str):
        # Read the adapter's config (a small file) before the harness loads the base model.
        peft_type = PeftConfig.from_pretrained(peft, revision=kwargs.get("revision") or "main").peft_type
        if not is_bitune_type(peft_type):
            raise ValueError(
                f"`peft={peft}` is a {peft_type_name(peft_type)} adapter; the `bitune` model evaluates "
                "Bitune adapters. Use the harness's `hf` model for it."
            )


def _check_batch_size(kwargs: dict[str, Any]) -> None:
    if str(kwargs.get("batch_size", 1)).startswith("auto"):
        raise ValueError(
            "`batch_size=auto` is not supported by the prefill-once scoring of the `bitune` model (the harness probes "
            "it with whole-sequence forwards); give an integer batch size."
        )


def _select_rows(cache: Cache, rows: torch.Tensor) -> Cache:
    """
    A cache holding the given batch rows of `cache` (repeats allowed), leaving `cache` untouched for later batches.

    The cache and its layers are copied shallowly and each copy selects its rows through the layer's own
    `batch_select_indices`, so per-layer bookkeeping (a sliding-window layer's running length) is kept.
    """
    selected = copy.copy(cache)
    selected.layers = [copy.copy(layer) for layer in cache.layers]
    selected.batch_select_indices(rows)
    return selected
