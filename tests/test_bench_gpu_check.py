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
