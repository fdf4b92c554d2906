"""The benchmark scripts run end to end and keep their output contract; their peak-memory tracker counts exactly.

Timings are never asserted here: performance targets live in the benchmark's own report.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
HEADLINE = ["train_ratio_to_bound", "train_memory_ratio", "prefill_ratio", "decode_ratio", "batching_speedup"]


def run_benchmark(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    return subprocess.run([sys.executable, str(BENCHMARKS / "run.py"), *args], capture_output=True, text=True,
                          env=env, timeout=600)


def positive_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_quick_run_on_a_tiny_model_writes_every_headline_ratio(tmp_path):
    out = tmp_path / "bench.json"
    result = run_benchmark("--quick", "--model", "tiny", "--rounds", "1", "--json", str(out))
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())

    for name in HEADLINE:
        assert positive_finite(report[name]), (name, report[name])
        assert report["targets"][name]["value"] is not None
        assert isinstance(report["targets"][name]["met"], bool)
    assert report["settings"]["model"] == "tiny" and report["settings"]["quick"] is True

    assert {(r["batch_size"], r["prompt_length"], r["answer_length"]) for r in report["train"]} == {
        (8, 32, 32), (8, 128, 32)}
    for row in report["train"]:
        for value in (row["time"]["ratio"], row["memory_ratio"], row["ratio_to_bound"], row["lora_peak_bytes"],
                      row["bitune_peak_bytes"], row["linear_flop_ratio"], row["ratio_to_linear_flops"]):
            assert positive_finite(value), row
        p, a = row["prompt_length"], row["answer_length"]
        assert row["compute_bound"] == pytest.approx((2 * p + a) / (p + a))
        assert row["ratio_to_bound"] == pytest.approx(row["time"]["ratio"] / row["compute_bound"])
        # Bitune reads the prompt twice but runs the LM head on the answer only, and its prompt passes end at the
        # last layer's keys/values: never more matmul FLOPs than the bound.
        assert row["linear_flop_ratio"] < row["compute_bound"]
    assert report["train_ratio_to_bound"] == max(r["ratio_to_bound"] for r in report["train"])

    assert sorted(r["batch_size"] for r in report["generation"]) == [1, 16]
    for row in report["generation"]:
        assert positive_finite(row["prefill"]["ratio"]) and positive_finite(row["decode"]["ratio"]), row
        assert positive_finite(row["prefill"]["denominator_s"]) and positive_finite(row["decode"]["numerator_s"])
    assert report["decode_ratio"] == max(r["decode"]["ratio"] for r in report["generation"])

    (batching,) = report["batching"]
    assert positive_finite(batching["bitune_speedup"]["ratio"]) and positive_finite(batching["bitune_examples_per_s"])
    assert report["batching_speedup"] == batching["bitune_speedup"]["ratio"]
    assert positive_finite(batching["lora_speedup"]["ratio"])
    assert report["lora_batching_speedup"] == batching["lora_speedup"]["ratio"]

    for table in ("Training step", "Generation", "Batching", "Targets"):
        assert table in result.stdout


@pytest.mark.slow
def test_fused_prompt_pass_estimate_prints_a_ratio_per_cell():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    result = subprocess.run([sys.executable, str(BENCHMARKS / "fused_prompt_passes.py"), "--model", "tiny",
                             "--rounds", "1"], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith(("inference", "training"))]
    assert [(mode, int(batch), int(p)) for mode, batch, p, *_ in rows] == [
        (mode, batch, p)
        for mode in ("inference", "training")
        for batch, p in ((1, 128), (8, 32), (8, 128), (16, 128))
    ]
    for *_, two, fused, ratio in rows:
        assert positive_finite(float(two)) and positive_finite(float(fused))
        assert float(ratio) == pytest.approx(float(fused) / float(two), abs=2e-3 + 0.06 * float(ratio))


def test_bf16_autocast_compares_each_precision_with_float64(tmp_path):
    report_path = tmp_path / "bf16.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "bf16_autocast.py"), "--model", "tiny", "--rounds", "1",
                             "--batch", "2", "--prompt", "6", "--answer", "3", "--json", str(report_path)],
                            capture_output=True, text=True, cwd=BENCHMARKS, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(report_path.read_text())
    groups = {"lora": {"causal weights"}, "bitune": {"causal weights", "bidirectional weights", "mixing scalars"}}
    for method, expected_groups in groups.items():
        measured = report["methods"][method]
        assert measured["speedup"] > 0 and set(measured["loss"]) == {"fp64", "fp32", "bf16"}
        for precision in ("fp32", "bf16"):
            assert set(measured["gradients_vs_fp64"][precision]) == expected_groups
        for agreement in measured["gradients_vs_fp64"]["fp32"].values():  # float32 is float64 to rounding
            assert agreement["cosine"] > 0.9999 and agreement["norm_ratio"] == pytest.approx(1, abs=1e-3)


@pytest.mark.slow
def test_prompt_pass_end_measurement_prints_a_ratio_per_cell():
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    command = [sys.executable, str(BENCHMARKS / "prompt_pass_end.py"), "--model", "tiny", "--rounds", "1"]
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("tiny")]
    assert [(" ".join(row[1:-6]), *map(int, row[-6:-3])) for row in rows] == [
        (workload, batch, p, a) for batch, p, a in ((1, 128, 32), (8, 128, 32), (8, 32, 32))
        for workload in ("prefill", "train step")
    ]
    for *_, stop, end, ratio in rows:
        assert positive_finite(float(stop)) and positive_finite(float(end))
        assert float(ratio) == pytest.approx(float(stop) / float(end), abs=2e-3 + 0.06 * float(ratio))


def test_a_missing_json_folder_is_refused_before_any_work(tmp_path):
    out = tmp_path / "missing" / "bench.json"
    result = run_benchmark("--quick", "--model", "tiny", "--json", str(out))
    assert result.returncode == 2
    assert "does not exist" in result.stderr
    assert "train:" not in result.stderr  # no cell ran
    assert not out.parent.exists()


@pytest.mark.parametrize("contents, models, message", [
    (None, ["smollm2"], "has no adapter_config.json"),
    ({"peft_type": "LORA"}, ["smollm2"], "holds a LORA adapter, not a BITUNE one"),
    ({"peft_type": "BITUNE"}, ["smollm2", "gemma3-270m"], "name it alone in `--models`"),
])
def test_bf16_gradients_refuses_a_point_that_is_not_a_bitune_adapter_before_any_work(tmp_path, contents, models,
                                                                                      message):
    if contents is not None:
        (tmp_path / "adapter_config.json").write_text(json.dumps(contents))
    out = tmp_path / "report.json"
    result = subprocess.run([sys.executable, str(BENCHMARKS / "bf16_gradients.py"), "--bitune_at", str(tmp_path),
                             "--models", *models, "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
    assert not out.exists()


def load_measure():
    """benchmarks/measure.py under a private name (the benchmark folder is a script folder, not a package)."""
    name = "bitune_benchmarks_measure"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / "measure.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def test_peak_memory_counts_tensors_made_during_the_call_until_they_are_freed():
    measure = load_measure()
    weight = torch.randn(256, 256, requires_grad=True)  # one 256 KiB block; exists before, never counted
    inputs = torch.randn(256, 256)
    block = 256 * 256 * 4

    def step():
        hidden = inputs @ weight  # 1 block, freed when relu is done
        activated = hidden.relu()  # 1 block, saved for backward
        del hidden
        scratch = torch.ones(1024, 256)  # 4 blocks, freed at once
        del scratch
        activated.sum().backward()  # gradient of `activated`, then relu's gradient, then weight.grad

    assert measure.peak_bytes_during(step, torch.device("cpu")) == 5 * block
    weight.grad = None

    def backward_peak():
        activated = (inputs @ weight).relu()
        activated.sum().backward()

    # relu output (saved) + relu's gradient + weight.grad, with the mm output already freed; a few scalars on top.
    peak = measure.peak_bytes_during(backward_peak, torch.device("cpu"))
    assert 3 * block <= peak < 3 * block + 1024


def test_smollm2_shape_is_the_real_models():
    """`--model smollm2` times the shape of SmolLM2-135M-Instruct (docs/smollm2.md): same layers, heads, vocabulary,
    tied embeddings and parameter count (built on the meta device: no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(BENCHMARKS))
    try:
        from models import MODEL_SIZES
    finally:
        sys.path.remove(str(BENCHMARKS))
    config = MODEL_SIZES["smollm2"].llama_config()
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (30, 576, 1536)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152 and config.tie_word_embeddings
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_serving_reuse_reads_only_new_turns_and_writes_its_report(tmp_path):
    pytest.importorskip("openai", reason="the serving benchmark needs the `serve` extra")
    spec = importlib.util.spec_from_file_location("serving_reuse", BENCHMARKS / "serving_reuse.py")
    serving_reuse = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serving_reuse)
    out = tmp_path / "serving.json"
    report = serving_reuse.main(["--model", "miniature", "--rounds", "1", "--max-tokens", "2", "--json", str(out)])
    assert json.loads(out.read_text()) == report
    result = report["models"]["miniature"]
    reuse, full = result["reuse"], result["full_prefill"]
    assert len(reuse) == len(full) == serving_reuse.TURNS
    assert [r["prompt_tokens"] for r in reuse] == [r["prompt_tokens"] for r in full]
    assert (
        all(r["read_tokens"] == r["prompt_tokens"] for r in full)
        and reuse[0]["read_tokens"] == full[0]["read_tokens"]
    )
    for turn, (with_reuse, without) in enumerate(zip(reuse[1:], full[1:]), start=2):
        assert with_reuse["cached_tokens"] > 0 and with_reuse["read_tokens"] < without["read_tokens"], turn
    for row in reuse + full:
        assert row["completion_tokens"] == 2 and positive_finite(row["time_to_first_token_s"]), row
    assert result["totals"]["read_tokens"]["reuse"] == sum(r["read_tokens"] for r in reuse)


def test_serving_throughput_compares_batched_with_one_at_a_time_and_writes_its_report(tmp_path):
    pytest.importorskip("openai", reason="the serving benchmark needs the `serve` extra")
    spec = importlib.util.spec_from_file_location("serving_throughput", BENCHMARKS / "serving_throughput.py")
    serving_throughput = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serving_throughput)
    with pytest.raises(SystemExit):
        serving_throughput.main(["--clients", "0"])
    out = tmp_path / "throughput.json"
    report = serving_throughput.main(["--clients", "1", "3", "--requests", "1", "--max-tokens", "2", "--rounds", "1",
                                      "--json", str(out)])
    assert json.loads(out.read_text()) == report
    assert report["clients"] == [1, 3] and report["identical"] is True
    assert set(report["throughput_ratio"]) == {"1", "3"}
    for count, cell in report["by_clients"].items():
        assert positive_finite(cell["throughput_ratio"])
        assert cell["throughput_ratio"] == report["throughput_ratio"][count]
        for arm in ("batched", "unbatched"):
            assert positive_finite(cell[arm]["tokens_per_s"]) and cell[arm]["ttft_median_s"] <= cell[arm]["ttft_p90_s"]
    # Every request of the 3 clients (a warm-up round and a measured one) went through the batching server's worker.
    assert sum(int(size) * n for size, n in report["by_clients"]["3"]["batch_sizes"].items()) == 2 * 3


def test_bf16_sensitivity_rounds_exactly_the_sites_a_row_names():
    """benchmarks/bf16_sensitivity.py's float64 emulation of bf16: no site rounded is float64 to the bit; every site
    rounds each kind of operation once per call (layers x projections x passes) and moves the gradient by about
    bf16's precision, as autocast does on this model; a scaled error is exact at scale 0 and the rounding at scale 1;
    a float32 island leaves its layers unrounded."""
    sys.path.insert(0, str(BENCHMARKS))
    import bf16_gradients
    import bf16_sensitivity
    from test_bf16_gradients import MIN_COSINE, bitune_model, padded_batch

    model, batch = bitune_model("llama"), padded_batch()  # 2 layers, LoRA on 7 projections, 3 passes
    bf16_gradients.to_precision(model, torch.float64)
    exact = bf16_sensitivity.gradients_at(model, batch, None)
    nothing = bf16_sensitivity.gradients_at(model, batch, bf16_sensitivity.Sites("no site", ()))
    assert all(torch.equal(nothing["gradients"][name], exact["gradients"][name]) for name in exact["gradients"])

    every, *kinds = bf16_sensitivity.site_rows(num_layers=2, block=1)[:5]
    measured = bf16_sensitivity.gradients_at(model, batch, every)
    assert measured["rounded_calls"] == {"base linears": 2 * 7 * 3, "LoRA linears": 2 * 7 * 3 * 2, "attention": 2 * 3,
                                         "LM head": 1}
    groups = bf16_gradients.agreement(measured["gradients"], exact["gradients"])
    cosines = [group["cosine"] for group in groups.values()]
    assert min(cosines) >= MIN_COSINE, cosines
    assert not any(torch.equal(measured["gradients"][name], exact["gradients"][name]) for name in exact["gradients"])
    for sites in kinds:
        assert set(bf16_sensitivity.gradients_at(model, batch, sites)["rounded_calls"]) == set(sites.kinds)
    projections = bf16_sensitivity.base_projections(model)
    assert projections == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    detail = bf16_sensitivity.site_rows(num_layers=2, block=1, detail_layers=(1,), projections=projections)[7:]
    names = [f"layers 1-1, {name}" for name in projections] + ["layer 1, every kind"]
    assert [sites.name for sites in detail] == names
    assert bf16_sensitivity.gradients_at(model, batch, detail[0])["rounded_calls"] == {"base linears": 3}  # 3 passes

    proportion = bf16_sensitivity.site_rows(num_layers=2, block=1, proportion_layer=1)[7:]
    assert [sites.name for sites in proportion] == [
        "layer 1, every kind, bfloat16 error x 0.125", "layer 1, every kind, bfloat16 error x 0.25",
        "layer 1, every kind, bfloat16 error x 0.5", "layer 1, every kind, rounded to bfloat16",
        "layer 1, every kind, bfloat16 error x -1", "layer 1, every kind, rounded to float16",
        "layer 1, every kind, rounded to float32"]
    scaled_to_zero = dataclasses.replace(proportion[0], rounding=bf16_sensitivity.Rounding(torch.bfloat16, 0.0))
    unscaled = bf16_sensitivity.gradients_at(model, batch, scaled_to_zero)
    assert all(torch.equal(unscaled["gradients"][name], exact["gradients"][name]) for name in exact["gradients"])
    scale_one = bf16_sensitivity.gradients_at(model, batch, proportion[3])["gradients"]
    layer_row = bf16_sensitivity.gradients_at(model, batch, detail[-1])["gradients"]
    assert all(torch.equal(scale_one[name], layer_row[name]) for name in layer_row)
    half = bf16_sensitivity.gradients_at(model, batch, proportion[2])  # halfway between exact and rounded, per tensor
    assert not any(torch.equal(half["gradients"][name], tensor) for name, tensor in exact["gradients"].items())
    in_float32 = bf16_sensitivity.gradients_at(model, batch, proportion[-1])
    for name, tensor in exact["gradients"].items():  # float32's rounding moves the gradient by float32's precision
        torch.testing.assert_close(in_float32["gradients"][name], tensor, rtol=1e-4, atol=1e-6 * tensor.abs().max())

    (island,) = bf16_sensitivity.site_rows(num_layers=2, block=1, exact_lower_layers=(1,))[7:]
    assert island.name == "every site but layers 0-0 (kept exact)"
    assert bf16_sensitivity.gradients_at(model, batch, island)["rounded_calls"] == {
        "base linears": 7 * 3, "LoRA linears": 7 * 3 * 2, "attention": 3, "LM head": 1}  # layer 1's and the head's


def _benchmark_module(name: str):
    """A benchmark script imported as a module (the benchmarks' folder first on the path, as when it runs)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_prompt_boundary_measures_both_ways_on_a_multi_head_shape(tmp_path, capsys):
    prompt_boundary = _benchmark_module("prompt_boundary")
    out = tmp_path / "boundary.json"
    report = prompt_boundary.main(["--model", "tiny", "--rounds", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["key_value_heads"] == 4  # tiny: 4 heads, all key/value
    cells = [(cell["batch_size"], cell["prompt_length"], cell["answer_length"]) for cell in report["cells"]]
    assert cells == prompt_boundary.CELLS
    for cell in report["cells"]:
        assert positive_finite(cell["time"]["ratio"]) and cell["time"]["rounds"] == 1
        assert positive_finite(cell["peak_bytes"]["recompute"]) and positive_finite(cell["peak_bytes"]["record"])
    with pytest.raises(SystemExit):
        prompt_boundary.main(["--model", "tiny", "--key_value_heads", "3"])
    assert "must divide the 4 query heads" in capsys.readouterr().err


def test_against_revision_compares_each_cell_by_its_bitune_over_lora_ratios(capsys):
    """The comparison of two trees divides the medians of each tree's Bitune/LoRA ratios, cell by cell; a revision that
    is not a commit is refused before any worktree is made."""
    against_revision = _benchmark_module("against_revision")

    def report(train: float, prefill: float, decode: float, flops: float) -> dict:
        return {"train": [{"batch_size": 8, "prompt_length": 32, "answer_length": 32, "time": {"ratio": train},
                           "ratio_to_linear_flops": flops}],
                "generation": [{"batch_size": 1, "prompt_length": 128, "prefill": {"ratio": prefill},
                                "decode": {"ratio": decode}}]}

    cells = against_revision.compare({"revision": [report(2.0, 1.8, 1.0, 1.5), report(2.2, 1.8, 1.1, 1.6),
                                                   report(2.4, 2.0, 1.0, 1.7)],
                                      "this": [report(1.9, 1.8, 1.0, 1.4), report(2.0, 1.9, 1.0, 1.5),
                                               report(2.3, 1.8, 1.0, 1.6)]})
    train = cells["train b=8 P=32 A=32: time"]
    assert train["medians"] == {"revision": 2.2, "this": 2.0}
    assert train["this_over_revision"] == pytest.approx(2.0 / 2.2)
    assert train["ratio_to_linear_flops"] == {"revision": 1.6, "this": 1.5}
    assert cells["generation b=1 P=128: prefill"]["this_over_revision"] == pytest.approx(1.8 / 1.8)
    assert cells["generation b=1 P=128: decode"]["this_over_revision"] == pytest.approx(1.0 / 1.0)
    with pytest.raises(SystemExit):
        against_revision.main(["--revision", "no-such-revision", "--", "--quick"])
    assert "is not a commit of this repository" in capsys.readouterr().err


def test_mixed_adapters_times_one_batch_against_the_split_and_writes_its_report(tmp_path):
    spec = importlib.util.spec_from_file_location("mixed_adapters", BENCHMARKS / "mixed_adapters.py")
    mixed_adapters = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(mixed_adapters)
        out = tmp_path / "mixed.json"
        report = mixed_adapters.main(["--model", "tiny", "--rounds", "1", "--new-tokens", "2", "--json", str(out)])
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert json.loads(out.read_text()) == report
    assert [(cell["batch_size"], cell["prompt_length"]) for cell in report["cells"]] == mixed_adapters.CELLS
    for cell in report["cells"]:
        for ratio in (cell["one_batch_over_split"], cell["one_batch_over_one_adapter"]):
            assert positive_finite(ratio["ratio"])
            assert ratio["ratio"] == pytest.approx(ratio["numerator_s"] / ratio["denominator_s"])
        assert cell["one_batch_over_split"]["numerator_s"] == cell["one_batch_over_one_adapter"]["numerator_s"]


def test_packing_counts_every_arms_tokens_times_its_epochs_and_resumes(tmp_path, capsys):
    packing = _benchmark_module("packing")
    out = tmp_path / "packing.json"
    tokenizer = str(BENCHMARKS.parent / "examples/miniature/base")
    common = ["--model", "tiny", "--data", "miniature", "--tokenizer", tokenizer, "--rows", "8", "--batch-size", "4",
              "--json", str(out)]
    report = packing.main([*common, "--rounds", "1"])
    assert json.loads(out.read_text()) == report
    epoch, arms = report["epoch"], report["arms"]
    prompts, answers = epoch["prompt_lengths"], epoch["answer_lengths"]
    assert epoch["supervised_tokens"] == sum(answers) and epoch["real_tokens"] == sum(prompts) + sum(answers)
    # Counted at the first decoder layer; packed arms compute exactly the real tokens of their passes.
    assert arms["lora_packed"]["decoder_tokens"] == epoch["real_tokens"]
    assert arms["bitune_packed"]["decoder_tokens"] == 2 * sum(p - 1 for p in prompts) + sum(a + 1 for a in answers)
    batch = epoch["batches"]["bitune_padded"][0]
    rows = [packing.Example([5] * (prompts[i] + answers[i]), prompts[i]) for i in batch]
    assert packing.decoder_tokens("bitune_padded", rows) == len(batch) * (
        2 * max(prompts[i] - 1 for i in batch) + max(answers[i] + 1 for i in batch))
    for padded in ("bitune_padded", "bitune_grouped"):
        assert arms["bitune_packed"]["decoder_tokens"] < arms[padded]["decoder_tokens"]
        assert sorted(sum(epoch["batches"][padded], [])) == list(range(8))  # the same rows, batched otherwise
    for method in ("bitune", "lora"):
        for figure in ("decoder_tokens", "linear_flops"):
            assert arms[f"{method}_packed"][figure] < arms[f"{method}_padded"][figure], (method, figure)
    for arm in packing.ARMS:
        entry = arms[arm]
        assert entry["tokens_per_supervised_token"] == pytest.approx(entry["decoder_tokens"] / sum(answers))
        assert entry["gpu_flops"] == entry["linear_flops"] + entry["attention_flops_varlen"] > 0
        assert positive_finite(entry["epoch_s"]) and len(report["batch_seconds"][arm][0]) == 2
    # Attention pairs by hand: 5 tokens, 3 of them instruction, 2 layers. LoRA: 2 * 15 causal pairs. Bitune: prompt
    # passes over m = 2 tokens (4 bidirectional + 3 causal pairs) on 1 layer, answer pass of q = 3 over them and
    # itself (6 + 6) on 2.
    example = packing.Example([5] * 5, 3)
    assert packing.attention_pairs("lora", example, 2) == 30 and packing.attention_pairs("bitune", example, 2) == 31
    for name, ratio in report["time_ratios"].items():
        assert ratio["ratio"] == pytest.approx(ratio["numerator_s"] / ratio["denominator_s"]), name
    assert {target["met"] for target in report["targets"].values()} <= {True, False}
    assert set(report["training_set"]["arms"]) == set(packing.ARMS) and report["load_average_end"]
    resumed = packing.main([*common, "--rounds", "2", "--resume"])
    assert resumed["rounds_done"] == 2 and resumed["complete"]
    assert [rounds[0] for rounds in resumed["batch_seconds"].values()] == [
        rounds[0] for rounds in report["batch_seconds"].values()]
    with pytest.raises(SystemExit):
        packing.main([*common[:-2], "--batch-size", "8", "--json", str(out), "--resume"])
    assert "was run with other settings" in capsys.readouterr().err
