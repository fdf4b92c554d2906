"""
The Bitune method as a PEFT tuner, in the manner of PEFT's `tuners/lora/`: everything a forward or a `generate` of a
Bitune adapter runs, and nothing else (no serving, evaluation, pictures or training aids: those import this package,
never the other way round).

Read in this order:

1. `config.py`: `BituneConfig`, what a user chooses (the inner PEFT method, mixing, multi-turn mode).
2. `model.py`: `BituneModel`, the tuner: the adapters' lifecycle, the training forward, `prefill` and `generate`.
3. `checks.py`: what the forward and `generate` are given, checked once where it enters.
4. `layout.py`: where each row's instructions and answers are, gathered into the batches of the passes.
5. `passes.py`: the two prompt passes and the answer pass over those batches.
6. `caches.py`, `mixing.py` and `layer_inputs.py`: the caches the passes read and record, the learned mix of the two
   prompt caches, and what a training step's prompt passes leave for the answer pass to mix where it reads it.
7. `routing.py`: which weight set the layers run with, pass by pass, also under gradient checkpointing; one call at a
   time per model.
8. `generation.py`: the prompt read twice before transformers' own `generate` decodes, and a conversation continued.

The rest adapts the method to its surroundings: `prompt_pass_end.py` (a prompt pass ends once its last layer has
recorded), `fused_head.py` (TRL's fused-head call), `sharding.py` (FSDP2), `quantization.py` (QLoRA bases) and
`find_tuner.py` (the tuner inside a wrapped model), `packing.py` (packed rows: example boundaries and per-pass
masks); `adapter_batches.py` runs a batch that names an adapter per row
(PEFT's `adapter_names`) as one batch, each pass routing every row to its own adapter's weight set.

Each input is checked once, where it enters, into a value that carries what the check learned; nothing downstream
checks it again. Followed through the modules, an `attention_mask` stays in each a single time:

- training forward: `model.py` (`forward`) -> `checks.check_training_inputs` (shapes, empty rows, holes,
  `position_ids`, positions; gives `TrainingInputs`, with each row's start and length) -> `layout.py` (the
  instruction/answer boundary; gives the chunks, each with its own mask) -> `passes.py` (runs the chunks).
- fresh `prefill` or `generate`: `model.py` -> `checks.check_prompts` (gives `Prompts`) -> `generation.py` (hands
  columns of `Prompts` to the passes, records the conversation on the cache) -> `passes.py`.
- continued chat: `model.py` -> `caches.BituneCache.checked_continuation` (the cache checks the input against the
  conversation it holds; gives `Prompts`) -> `generation.py` -> `passes.py`.
"""
