"""benchmarks/gpu_check.py, benchmarks/training_memory.py and benchmarks/sdpa_backends.py: the GPU check runs every
part on tiny shapes on the CPU and writes every field; bad input is refused before anything is built; the memory
measurement's shortcuts give exactly what they stand for. Timings are never asserted here."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import gpu_check  # noqa: E402
import sdpa_backends  # noqa: E402
import training_memory  # noqa: E402
from measure import peak_bytes_during  # noqa: E402
from models import REAL_SHAPES, TINY_SHAPES, RealShape, build_pair, training_batch  # noqa: E402

CPU = torch.device("cpu")


def positive_finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@pytest.mark.slow
def test_smoke_run_on_the_cpu_writes_every_field(tmp_path):
    out = tmp_path / "gpu.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    result = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_check.py"), "--device", "cpu", "--smoke",
                             "--peak_tflops", "0.1", "--json", str(out)], capture_output=True, text=True, env=env,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert "exact" in result.stdout and "math fallback" in result.stdout  # the table
    assert report["peak_bf16_tflops"] == 0.1 and report["settings"]["smoke"] is True
    assert set(report["environment"]) >= {"torch", "transformers", "peft", "python", "flash_attn_importable"}
    assert list(report["shapes"]) == ["tiny-gemma", "tiny-llama"]
    assert report["summary"] == {"exact": True, "math_fallbacks": {"tiny-gemma": [], "tiny-llama": []},
                                 "skipped": []}
    for shape in report["shapes"].values():
        exactness = shape["exactness"]
        for part in ("forward_left_padded", "forward_right_padded"):
            assert exactness[part]["exact"] is True, exactness[part]
            assert set(exactness[part]["max_abs_difference"]["gradients"]) == {"bidirectional", "causal", "mixing"}
        assert exactness["generate"]["exact"] is True and len(exactness["generate"]["rows"]) == 4

        gradients = shape["bf16_gradients"]
        assert set(gradients["lora"]) == {"lora weights"}
        assert set(gradients["bitune"]) == {"bidirectional weights", "causal weights", "mixing scalars"}
        for agreement in [*gradients["lora"].values(), *gradients["bitune"].values()]:
            assert -1 <= agreement["cosine"] <= 1 and positive_finite(agreement["norm_ratio"])

        for setting in ("no_checkpointing", "checkpointing"):
            train = shape["speed"]["train"][setting]
            assert (train["batch_size"], train["prompt_length"], train["answer_length"]) == (2, 16, 8)
            for value in (train["time"]["ratio"], train["time_ratio_median"], train["linear_flop_ratio"],
                          train["lora_peak_bytes"], train["bitune_peak_bytes"],
                          *train["achieved_linear_tflops"].values(), *train["model_flop_utilisation"].values()):
                assert positive_finite(value), train
        assert set(shape["speed"]["generation"]) == {"batch_1", "batch_16"}
        for cell in shape["speed"]["generation"].values():
            assert positive_finite(cell["prefill"]["median_ratio"]) and positive_finite(cell["decode"]["median_ratio"])

        kernels = shape["attention_kernels"]
        for run, passes in (("training_without_padding", ("bidirectional_prompt", "causal_prompt", "answer")),
                            ("training_with_padding", ("bidirectional_prompt", "causal_prompt", "answer")),
                            ("generation", ("bidirectional_prompt", "causal_prompt", "decoding"))):
            for name in passes:
                seen = kernels[run][name]
                assert seen["calls"] > 0 and seen["math_fallback"] is False and set(seen["backends"]) == {"cpu_flash"}
        assert shape["flash_attention_2"]["importable"] in (True, False)

        memory = shape["memory"]
        assert memory["checkpointing"] is True and set(memory["peak_bytes"]) == set(training_memory.METHODS)
        assert all(positive_finite(peak) for peak in memory["peak_bytes"].values())
        assert memory["bitune_over_lora"] == memory["peak_bytes"]["bitune"] / memory["peak_bytes"]["lora"]


def test_without_trl_the_memory_part_measures_what_needs_no_fused_head(monkeypatch):
    """LoRA's and Bitune's steps both go through TRL's fused head: without TRL neither is measured (each says why),
    and no ratio is reported; the plain LoRA step still is."""
    monkeypatch.setitem(sys.modules, "trl.trainer.utils", None)  # `import trl.trainer.utils` now raises ImportError
    plan = gpu_check.Plan(smoke=True)
    _, config = plan.configs()[1]
    memory = gpu_check.check_memory(config, plan, torch.device("cpu"))
    assert set(memory["peak_bytes"]) == {"lora_full_logits"}
    assert positive_finite(memory["peak_bytes"]["lora_full_logits"])
    assert set(memory["not_measured"]) == set(training_memory.FUSED_HEAD_METHODS)
    assert all("trl does not import" in reason for reason in memory["not_measured"].values())
    assert not any(key.startswith("bitune_over") for key in memory)


def test_cuda_without_a_gpu_is_refused_in_one_line_before_any_model_is_built(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "random_base", lambda *args, **kwargs: pytest.fail("a model was built"))
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--device", "cuda"])
    message = str(exit_info.value.code)
    assert "--device cuda" in message and "no CUDA device" in message and "\n" not in message


def test_shapes_that_do_not_fit_are_refused_in_one_line_before_any_model_is_built(monkeypatch):
    monkeypatch.setattr(gpu_check, "random_base", lambda *args, **kwargs: pytest.fail("a model was built"))
    monkeypatch.setattr(gpu_check, "build_pair", lambda *args, **kwargs: pytest.fail("a model was built"))
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--device", "cpu", "--memory_gib", "4"])
    message = str(exit_info.value.code)
    assert message.startswith("gpu_check: the gemma-2b shape needs about ") and "4.0 GiB is free" in message
    assert "\n" not in message
    # The smoke shapes fit in the same memory.
    assert gpu_check.refusal(gpu_check.parse_args(["--device", "cpu", "--memory_gib", "4", "--smoke"]),
                             gpu_check.Plan(smoke=True)) is None


def test_a_missing_json_folder_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.main(["--device", "cpu", "--smoke", "--json", str(tmp_path / "missing" / "gpu.json")])
    assert "does not exist" in capsys.readouterr().err


def test_the_parameter_count_behind_the_refusal_is_the_models():
    from transformers import AutoModelForCausalLM

    for shape in (REAL_SHAPES["gemma-2b"], REAL_SHAPES["llama-3-8b"]):
        config = shape.config(4)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        actual = sum(p.numel() for p in model.parameters())
        assert actual * 0.999 < gpu_check.parameter_count(config) <= actual  # norms left out


def test_a_part_past_its_budget_is_skipped_not_run():
    budget = gpu_check.Budget({"speed": 0.0})
    assert budget.run("speed", lambda: pytest.fail("ran"), print) == {
        "skipped": "the part's time budget (0.0 s) was used up"}


def test_real_shapes_are_the_published_models():
    """Parameter counts of the published models (built on the meta device: no memory, no weights)."""
    from transformers import AutoModelForCausalLM

    expected = {"smollm2-135m": 134_515_008, "gemma-3-270m": 268_098_176, "gemma-2b": 2_506_172_416,
                "gemma-7b": 8_537_680_896, "llama-3-8b": 8_030_261_248}
    for name, count in expected.items():
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(REAL_SHAPES[name].config())
        assert sum(p.numel() for p in model.parameters()) == count, name


# -------------------------------------------------------------------------------------------- attention kernels
def test_sdpa_backends_are_told_apart_and_the_math_fallback_is_flagged():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pair = build_pair(TINY_SHAPES["tiny-llama"].config(), CPU, torch.float32, "sdpa")
    model = pair.bitune.train()
    batch = training_batch(2, 9, 4, 512, CPU)
    calls = sdpa_backends.recorded_calls(lambda: model(**batch).loss.backward())
    passes = sdpa_backends.bitune_training_passes(calls, num_layers=2)
    assert passes["bidirectional_prompt"]["query_key_lengths"] == [(8, 8)]
    assert passes["answer"]["query_key_lengths"] == [(5, 13)] and passes["answer"]["calls"] == 2
    assert not any(seen["math_fallback"] for seen in passes.values())
    with sdpa_kernel([SDPBackend.MATH]):
        calls = sdpa_backends.recorded_calls(lambda: model(**batch).loss.backward())
    passes = sdpa_backends.bitune_training_passes(calls, num_layers=2)
    assert all(seen["math_fallback"] and set(seen["backends"]) == {"math"} for seen in passes.values())
    assert passes["answer"]["query_key_lengths"] == [(5, 13)]


# -------------------------------------------------------------------------------------------- training memory
def test_skipping_the_matmul_arithmetic_gives_exactly_the_measured_peak():
    config = TINY_SHAPES["tiny-gemma"].config()
    for method in training_memory.METHODS:
        for checkpointing in (True, False):
            peaks = [training_memory.measure_method(config, method, checkpointing, (2, 8, 4), CPU, torch.bfloat16,
                                                    skip_arithmetic=skip) for skip in (True, False)]
            assert peaks[0] == peaks[1] > 0, (method, checkpointing, peaks)
    heads = [training_memory.fused_head_bytes(config, (2, 8, 4), CPU, torch.bfloat16, skip_arithmetic=skip)
             for skip in (True, False)]
    assert heads[0] == heads[1] and heads[0][0] > 0


def test_the_head_as_on_cuda_scores_the_answer_positions_without_the_cpu_folds_temporaries():
    """On a CPU the measurement runs TRL's head as CUDA runs it: the supervised positions only (so its peak does not
    grow with the prompt), and none of the float32 tile temporaries of TRL's CPU folds (so it is under the CPU
    head's own peak at the same positions). TRL's own functions are back once the measurement is done."""
    from trl.kernels import chunked_logprob
    from trl.trainer import utils as trl_utils

    config = TINY_SHAPES["tiny-gemma"].config()
    short, long = (training_memory.fused_head_bytes(config, (2, prompt, 4), CPU, torch.bfloat16, True)
                   for prompt in (8, 64))
    assert short == long and short[1] == 2 * 4
    originals = (trl_utils._use_triton, chunked_logprob._forward_tile, chunked_logprob._backward_tile,
                 chunked_logprob._addmm_fp32)
    with training_memory.fused_head_as_on_cuda(CPU):
        assert trl_utils._use_triton(CPU) is True
    assert (trl_utils._use_triton, chunked_logprob._forward_tile, chunked_logprob._backward_tile,
            chunked_logprob._addmm_fp32) == originals and trl_utils._use_triton(CPU) is False
    hidden = torch.zeros(8, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.zeros(config.vocab_size, config.hidden_size, dtype=torch.bfloat16)

    def cpu_head() -> None:
        log_probs = chunked_logprob.ChunkedLogProbFunction.apply(
            hidden, weight, None, torch.zeros(8, dtype=torch.long), 1.0, trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE,
            None, 1.0, training_memory.SFT_FIELDS)[0]
        (-log_probs).sum().backward()

    assert peak_bytes_during(cpu_head, CPU) > short[0]


def test_per_layer_extrapolation_reaches_the_peak_measured_at_full_depth():
    shape = TINY_SHAPES["tiny-llama"]  # 2 layers: measured at 1 and 2, extrapolated to 2
    result = training_memory.measure_shape(shape, [1, 2], (2, 8, 4), CPU, torch.bfloat16, True, 1.0,
                                           methods=("bitune", "lora"), log=lambda line: None)
    assert result["extrapolated"] is True and result["measured_layers"] == [1, 2]
    for key in ("bitune", "bitune_checkpointing", "lora", "lora_checkpointing"):
        measured = result["measured_peak_bytes"][key]
        assert result["peak_bytes"][key] == measured["2"]
        assert result["per_layer_bytes"][key] == measured["2"] - measured["1"]
    assert result["bitune_over_lora"]["_checkpointing"] == (
        result["peak_bytes"]["bitune_checkpointing"] / result["peak_bytes"]["lora_checkpointing"])
    excess = result["bitune_excess_over_lora"]["_checkpointing"]
    assert excess["per_layer_bytes"] == (result["per_layer_bytes"]["bitune_checkpointing"]
                                         - result["per_layer_bytes"]["lora_checkpointing"])
    assert excess["floor_per_layer_bytes"] * 2 == excess["floor_bytes"] == result["second_pass_inputs"]["bytes"]


def test_the_second_pass_inputs_are_what_checkpointing_keeps_of_the_bidirectional_pass():
    """`second_pass_inputs_bytes` is derived from the config; here it is counted: the bytes of every decoder layer's
    input to the bidirectional prompt pass (the first pass of a step), which a checkpointed layer keeps."""
    for name, batch_shape in (("tiny-llama", (2, 8, 4)), ("tiny-gemma", (3, 6, 2))):
        config = TINY_SHAPES[name].config()
        model = training_memory.prepared_model(training_memory.base_model(config, CPU, torch.bfloat16, True),
                                               "bitune", checkpointing=False)
        inputs = []
        layers = model.base_model.model.model.layers
        handles = [layer.register_forward_pre_hook(lambda module, args, kwargs: inputs.append(
            (args[0] if args else kwargs["hidden_states"]).nbytes), with_kwargs=True) for layer in layers]
        with torch.no_grad():
            model(**training_batch(*batch_shape, config.vocab_size, CPU), fused_lm_head=True)
        for handle in handles:
            handle.remove()
        assert len(inputs) == 3 * config.num_hidden_layers  # bidirectional, causal and answer pass, every layer
        second_pass = sum(inputs[: config.num_hidden_layers])
        assert second_pass == training_memory.second_pass_inputs_bytes(config, batch_shape, torch.bfloat16) > 0


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gemma", "tiny-llama-multi-head"])
def test_with_checkpointing_bitune_keeps_per_layer_only_the_second_pass_inputs(name):
    """Per decoder layer, a checkpointed Bitune step holds beyond LoRA's the second prompt pass's layer input, and
    nothing else but the mixing scalars' per-layer temporaries (a few float32 numbers): no key/value record of a
    prompt pass outlives its layer, and neither does their mix or any gradient between the passes, each of which
    would exceed the margin (`tuner/layer_inputs.py`). Grouped-query and multi-head shapes alike."""
    batch_shape = (4, 64, 16)
    shape = TINY_SHAPES[name.removesuffix("-multi-head")]
    if name.endswith("-multi-head"):
        shape = _multi_head(shape)
    config = shape.config()
    result = training_memory.measure_shape(shape, [1, 2], batch_shape, CPU, torch.bfloat16, True, 1.0,
                                           methods=("bitune", "lora"), log=lambda line: None)
    cell = result["bitune_excess_over_lora"]["_checkpointing"]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    key_values_per_layer = 2 * 2 * 4 * config.num_key_value_heads * 63 * head_dim * 2  # both passes, bf16
    assert cell["floor_per_layer_bytes"] == 4 * 63 * config.hidden_size * 2 > 64  # the second pass's inputs, bf16
    assert key_values_per_layer > 64
    assert abs(cell["per_layer_bytes"] - cell["floor_per_layer_bytes"]) <= 64, cell


def _multi_head(shape: RealShape) -> RealShape:
    """`shape` with as many key/value heads as query heads."""

    def make(layers: int):
        config = shape.config(layers)
        config.num_key_value_heads = config.num_attention_heads
        return config

    return RealShape(f"{shape.name}-multi-head", shape.num_hidden_layers, make)


def test_training_memory_cli_writes_its_report_and_refuses_bad_input(tmp_path, capsys):
    out = tmp_path / "memory.json"
    report = training_memory.main(["--shapes", "tiny-gemma", "--batch", "2", "--prompt", "8", "--answer", "4",
                                    "--memory_cap_gib", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    shape = report["shapes"]["tiny-gemma"]
    assert set(shape["peak_bytes"]) == {f"{m}{c}" for m in training_memory.METHODS for c in ("", "_checkpointing")}
    assert report["settings"]["dtype"] == "bfloat16" and report["settings"]["arithmetic"] == "skip"
    head = shape["fused_head"]  # as on CUDA: the answer positions of both methods (A a row)
    assert head["positions"] == 2 * 4
    assert 0 < head["peak_bytes"] <= min(shape["peak_bytes"]["lora"], shape["peak_bytes"]["bitune"])
    second_pass = shape["second_pass_inputs"]  # tiny-gemma: 2 layers, hidden size 64; the passes read 7 tokens
    assert second_pass == {"bytes": 2 * 2 * 7 * 64 * 2, "per_layer_bytes": 2 * 7 * 64 * 2}
    assert "prompt_boundary" not in shape  # nothing held between the passes across layers
    assert shape["activation_floor_ratio"] == (7 + 7 + 5) / 12
    floor = second_pass["bytes"]
    assert shape["bitune_excess_over_lora"]["_checkpointing"]["floor_bytes"] == floor
    assert "floor_bytes" not in shape["bitune_excess_over_lora"][""]
    for setting in ("", "_checkpointing"):
        cell = shape["bitune_excess_over_lora"][setting]
        peaks = shape["peak_bytes"]
        assert cell["bytes"] == peaks[f"bitune{setting}"] - peaks[f"lora{setting}"]
        assert "per_layer_bytes" not in cell  # measured at full depth
        assert shape["bitune_over_lora"][setting] == peaks[f"bitune{setting}"] / peaks[f"lora{setting}"]
    assert "against a floor of" in capsys.readouterr().out
    for argv, words in ((["--layers", "2", "2"], "two different layer counts"),
                        (["--prompt", "1"], "--prompt at least 2"),
                        (["--json", str(tmp_path / "missing" / "m.json")], "does not exist")):
        with pytest.raises(SystemExit):
            training_memory.main(argv)
        assert words in capsys.readouterr().err


def test_training_memory_remeasures_one_method_and_keeps_the_others(tmp_path, capsys):
    out = tmp_path / "memory.json"
    small = ["--batch", "2", "--prompt", "8", "--answer", "4", "--methods", "lora", "bitune", "--json", str(out)]
    first = training_memory.main(["--shapes", "tiny-gemma", *small])
    marked = json.loads(json.dumps(first))
    for shape in marked["shapes"].values():  # marks: kept figures are read back, remeasured ones measured again
        shape["peak_bytes"]["lora_checkpointing"] += 1000
        shape["peak_bytes"]["bitune_checkpointing"] = -1
        shape["fused_head"]["peak_bytes"] = -1
    out.write_text(json.dumps(marked))
    again = training_memory.main([*small, "--remeasure", "bitune"])
    assert again["remeasured"]["methods"] == ["bitune"]
    assert json.loads(out.read_text()) == json.loads(json.dumps(again))
    for name, shape in again["shapes"].items():
        before = first["shapes"][name]
        assert shape["peak_bytes"]["lora_checkpointing"] == before["peak_bytes"]["lora_checkpointing"] + 1000
        for key in ("bitune_checkpointing", "bitune", "lora"):
            assert shape["peak_bytes"][key] == before["peak_bytes"][key]
        assert shape["measured_peak_bytes"] == before["measured_peak_bytes"]
        assert shape["fused_head"] == before["fused_head"]
        assert shape["bitune_over_lora"]["_checkpointing"] == (
            shape["peak_bytes"]["bitune_checkpointing"] / shape["peak_bytes"]["lora_checkpointing"])
        assert shape["bitune_excess_over_lora"]["_checkpointing"]["bytes"] == (
            before["bitune_excess_over_lora"]["_checkpointing"]["bytes"] - 1000)
    for argv, words in ((["--remeasure", "bitune"], "give that report's file as --json"),
                        ([*small, "--remeasure", "bitune", "--resume"], "cannot be combined"),
                        ([*small, "--batch", "3", "--remeasure", "bitune"], "other settings"),
                        (["--shapes", "tiny-llama", *small, "--remeasure", "bitune"], "holds no tiny-llama")):
        with pytest.raises(SystemExit) as exited:
            training_memory.main(argv)
        assert words in capsys.readouterr().err + str(exited.value)


def test_training_memory_resumes_a_report_with_its_measured_shapes_kept(tmp_path, capsys):
    out = tmp_path / "memory.json"
    small = ["--batch", "2", "--prompt", "8", "--answer", "4", "--methods", "bitune", "--json", str(out)]
    first = training_memory.main(["--shapes", "tiny-gemma", *small])
    kept = first["shapes"]["tiny-gemma"]
    kept["peak_bytes"]["bitune"] = -1  # a mark: a kept shape is read back, not measured again
    out.write_text(json.dumps(first))
    resumed = training_memory.main(["--shapes", "tiny-gemma", "tiny-llama", *small, "--resume"])
    assert list(resumed["shapes"]) == ["tiny-gemma", "tiny-llama"]
    assert resumed["shapes"]["tiny-gemma"]["peak_bytes"]["bitune"] == -1
    assert resumed["shapes"]["tiny-llama"]["peak_bytes"]["bitune"] > 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(resumed))
    capsys.readouterr()
    for argv, words in ((["--shapes", "tiny-llama", *small, "--resume"], "shapes not asked for now (tiny-gemma)"),
                        (["--shapes", "tiny-gemma", "tiny-llama", *small, "--batch", "3", "--resume"],
                         "other settings"),
                        (["--shapes", "tiny-gemma", "--resume", "--json", str(tmp_path / "none.json")],
                         "give that report's file as --json")):
        with pytest.raises(SystemExit) as refused:
            training_memory.main(argv)
        assert words in str(refused.value) + capsys.readouterr().err


def test_training_docs_hold_the_committed_memory_measurement():
    report = json.loads((BENCHMARKS.parent / "docs" / "results" / "training_memory.json").read_text())
    assert list(report["shapes"]) == [*training_memory.FULL_DEPTH, *training_memory.EXTRAPOLATED]
    assert report["settings"]["batch_size"] == 4 and report["settings"]["prompt_length"] == 512
    assert report["settings"]["answer_length"] == 256 and report["settings"]["dtype"] == "bfloat16"
    assert all("fused_head" in shape for shape in report["shapes"].values())
    page = (BENCHMARKS.parent / "docs" / "training.md").read_text(encoding="utf-8")
    assert training_memory.markdown(report) in page
    assert training_memory.excess_markdown(report) in page
