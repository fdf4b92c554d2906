"""The benchmark table in docs/serving.md ("On vLLM") is what benchmarks/serving_vllm.py prints for the recorded
docs/results/serving_vllm.json, not numbers typed by hand."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from benchmarks.serving_vllm import table  # noqa: E402


def test_docs_table_is_the_recorded_results():
    with open(os.path.join(ROOT, "docs", "results", "serving_vllm.json"), encoding="utf-8") as file:
        result = json.load(file)
    with open(os.path.join(ROOT, "docs", "serving.md"), encoding="utf-8") as file:
        page = file.read()
    assert table(result) in page.split("## On vLLM", 1)[1]
