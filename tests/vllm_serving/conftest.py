"""The vLLM tests run only in the vLLM environment (the `vllm` job of .ci/run): importing vllm here fails, not skips,
where it is missing. The engine runs in this process on the CPU, as the issue measured it."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import vllm  # noqa: E402,F401  (a missing vLLM fails the job here)
