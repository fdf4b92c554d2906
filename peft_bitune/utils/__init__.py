"""
Small helpers with no knowledge of the method: what peft-bitune reads of a base model (`base_model.py`), type checks of
config fields (`field_types.py`), numbers from a command line (`command_line_numbers.py`) and pieces of error messages
(`messages.py`).
"""
