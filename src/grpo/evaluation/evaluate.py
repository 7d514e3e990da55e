"""Greedy accuracy and format rate of a model (+ adapter) on a split.

Baseline and final evaluation run the same code. The policy is first exported as dense
weights (``grpo.model.lora_policy.export_dense``): the base loaded as training loads it (NF4 when
``model.quantization`` is ``nf4``), dequantised, with the LoRA adapter merged for the final
evaluation. That directory is then decoded greedily by vLLM when installed (transformers
otherwise, logged), so the two evaluations differ by the adapter only.

Metrics: ``accuracy`` (final answer equals the reference, ``grpo.algorithm.rewards.correctness``),
``format_rate`` (the completion ends with a strict ``#### N`` line), ``n``; the accuracy's 95%
interval that counts a problem once (``ci_low``, ``ci_high``: ``grpo.algorithm.stats.clustered_interval`` over
the operand multisets, ``grpo.data.answers.cluster_key``), with ``clusters`` (distinct problems),
``effective_n``, ``design_effect`` and ``ci_method``; what the answers show (``grpo.data.answers``):
``failure_classes`` (counts per class) and ``accuracy_by_operand_digits``. ``accuracy_ci95_low`` /
``accuracy_ci95_high`` are the Wilson interval of independent rows, kept for earlier readers.
"""

from __future__ import annotations

import time
from pathlib import Path

from grpo.algorithm.rewards import correctness, extract_answer, format_strict
from grpo.algorithm.stats import CLUSTERED_METHOD, clustered_interval, wilson
from grpo.core.jsonio import read_jsonl
from grpo.data.answers import accuracy_by_digits, class_counts, cluster_key
from grpo.data.sources import prompts_that_fit, sequence_positions
from grpo.model.base_model import check_model_dir, load_tokenizer
from grpo.model.lora_policy import export_dense
from grpo.rollout.engine.sampler import SavedModelRun, saved_model_sampler
from grpo.rollout.rollout_backends import DecodeChoice, generate_in_batches, planned_tokens


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% (z = 1.96) Wilson score interval of a binomial proportion k / n."""
    return wilson(k / n if n else 0.0, n, z)


def what_was_learned(rows: list[dict], correct: list[float]) -> dict:
    """The metrics of ``score`` beyond accuracy: the interval that counts each operand multiset once
    and the answers' failure classes and accuracy by operand digits (``grpo.data.answers``), from the
    rows with their per-problem ``completion`` and ``correct``."""
    ci = clustered_interval([c > 0 for c in correct], [cluster_key(r["question"]) for r in rows])
    return {"ci_low": ci.low, "ci_high": ci.high, "ci_method": CLUSTERED_METHOD, "clusters": ci.clusters,
            "effective_n": ci.effective_n, "design_effect": ci.design_effect,
            "failure_classes": class_counts(rows), "accuracy_by_operand_digits": accuracy_by_digits(rows)}


def score(rows: list[dict], completions: list[str]) -> tuple[dict, list[dict]]:
    """Metrics and per-problem records of greedy ``completions`` (one per row)."""
    answers = [r["answer"] for r in rows]
    correct = correctness(completions, answers)
    formatted = format_strict(completions, answers)
    k, n = int(sum(correct)), len(rows)
    lo, hi = wilson_interval(k, n)
    metrics = {"accuracy": k / n, "format_rate": sum(f > 0 for f in formatted) / n, "n": n,
               "accuracy_ci95_low": lo, "accuracy_ci95_high": hi}
    per_problem = [
        {"id": r["id"], "question": r["question"], "answer": r["answer"], "completion": c,
         "extracted": extract_answer(c), "correct": bool(ok), "formatted": f > 0}
        for r, c, ok, f in zip(rows, completions, correct, formatted)
    ]
    metrics.update(what_was_learned(per_problem, correct))
    return metrics, per_problem


def evaluate(params, adapter_dir: str | Path | None, work_dir: str | Path) -> tuple[dict, list[dict]]:
    """Export the policy (base, or base + ``adapter_dir``) to ``work_dir`` and score it greedily
    on ``params.evaluate.test_path`` (the rows whose prompt fits ``evaluate.max_model_len``:
    ``grpo.data.sources.prompts_that_fit``); a missing base model is refused before anything is written
    (``grpo.model.base_model.check_model_dir``); the engine is shut down before it returns, so evaluations can
    follow one another in one process."""
    cfg = params.evaluate
    t0 = time.perf_counter()
    rows = read_jsonl(cfg.test_path)
    check_model_dir(params.model.path)
    tokenizer = load_tokenizer(params.model.path)  # the one export_dense saves beside the weights
    rows, prompts = prompts_that_fit(tokenizer, rows, params.train.system_prompt, cfg, cfg.test_path)
    export = export_dense(params.model, adapter_dir, Path(work_dir) / "weights")
    completions = []
    run = SavedModelRun(dtype=params.model.dtype, dtype_key="model.dtype",
                        positions=sequence_positions(tokenizer, prompts, cfg.max_new_tokens))
    with saved_model_sampler(cfg.backend, tokenizer, export["path"], cfg, run=run,
                             decode=DecodeChoice(params.decode, planned_tokens(len(prompts), cfg))
                             ) as sampler:  # closed after
        for _, roll in generate_in_batches(sampler, prompts, 1, batch_prompts=cfg.batch_prompts, desc="evaluate",
                                           max_new_tokens=cfg.max_new_tokens, temperature=0.0):
            completions += roll.texts
    metrics, per_problem = score(rows, completions)
    metrics.update(backend=sampler.name, weights=export["weights"], decoding="greedy", max_new_tokens=cfg.max_new_tokens,
                   wall_s=round(time.perf_counter() - t0, 1))
    return metrics, per_problem
