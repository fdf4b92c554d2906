"""
A Bitune adapter on disk and on the Hub: its checkpoint keys (`checkpoint_keys.py`), its `adapter_config.json`
(`config_files.py`), the weights file it is loaded from (`weights_files.py`), the base model it belongs to
(`base_model_records.py`), its model card (`model_card.py`) and pushing it to the Hub (`hub.py`).

Saving and loading are PEFT's own; these are the hooks PEFT calls and the checks made before it loads anything.
Nothing here imports the method (`peft_bitune.tuner`), which uses these hooks.
"""
