"""
Training aids for any `transformers.Trainer` (TRL's included): the mixing coefficients in the training logs and a
mixing warm-up (`callbacks.py`), and separate learning rates for the parts of a Bitune adapter (`optimizers.py`).

The trainers themselves are in `trl_integration`.
"""
