"""Stage ``sent``: sample M answers per training prompt (vLLM, or the transformers fallback),
score each prompt by semantic entropy and write the training set sorted easy -> hard.

Outputs: ``data/cache/train_sorted.jsonl`` and ``metrics/sent.json`` (backend, wall time, tokens).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from grpo.config.reading import Params
from grpo.config.sections.decode import DecodeConfig
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.sent import SentConfig
from grpo.config.sections.shared import OtherStagesTrainKeys
from grpo.core.device import default_device, sampling_dtype
from grpo.core.jsonio import read_jsonl, write_json, write_jsonl
from grpo.data.sources import prompts_that_fit, sequence_positions
from grpo.model.base_model import check_model_dir, load_tokenizer
from grpo.rollout.engine.sampler import SavedModelRun, saved_model_sampler
from grpo.rollout.rollout_backends import DecodeChoice, planned_tokens
from grpo.rollout.semantic_entropy import score_rows
from tasks._common import run_stage

log = logging.getLogger(__name__)


def sent(params: Params) -> dict:
    cfg = params.sent
    t0 = time.perf_counter()
    rows = read_jsonl(cfg.data_path)
    check_model_dir(params.model.path)
    tokenizer = load_tokenizer(params.model.path)
    rows, prompts = prompts_that_fit(tokenizer, rows, params.train.system_prompt, cfg, cfg.data_path)
    dtype = sampling_dtype(cfg.dtype, default_device())
    run = SavedModelRun(seed=cfg.seed, dtype=dtype, enforce_eager=cfg.enforce_eager,
                        positions=sequence_positions(tokenizer, prompts, cfg.max_new_tokens))
    with saved_model_sampler(cfg.backend, tokenizer, params.model.path, cfg, run=run,
                             decode=DecodeChoice(params.decode, planned_tokens(len(prompts), cfg))
                             ) as sampler:  # the engine is closed after sampling
        t_ready = time.perf_counter()
        log.info("backend %s (%s) ready in %.1f s; sampling %d x %d answers", sampler.name, dtype, t_ready - t0,
                 len(rows), cfg.num_samples)
        ranked, totals = score_rows(rows, prompts, sampler, cfg)
        t_done = time.perf_counter()
    write_jsonl(cfg.out_path, ranked)
    entropies = [r["semantic_entropy"] for r in ranked]
    summary = {
        "backend": sampler.name,
        "dtype": dtype,
        "rows": len(ranked),
        "num_samples": cfg.num_samples,
        "estimator": cfg.estimator,
        **totals,
        "setup_s": round(t_ready - t0, 2),
        "generate_s": round(t_done - t_ready, 2),
        "wall_s": round(t_done - t0, 2),
        "tokens_per_s": round(totals["completion_tokens"] / max(t_done - t_ready, 1e-9), 1),
        "entropy_mean": sum(entropies) / len(entropies),
        "zero_entropy_frac": sum(e == 0 for e in entropies) / len(entropies),
        "pass_rate_mean": sum(r["pass_rate"] for r in ranked) / len(ranked),
    }
    write_json(Path(params.train.metrics_dir) / "sent.json", summary)
    log.info("wrote %s: %d prompts x %d answers in %.0f s (%.0f tokens/s), semantic entropy mean %.3f "
             "(%.0f%% of prompts at 0), pass rate mean %.3f; the rest in %s", cfg.out_path, summary["rows"],
             cfg.num_samples, summary["generate_s"], summary["tokens_per_s"], summary["entropy_mean"],
             100 * summary["zero_entropy_frac"], summary["pass_rate_mean"], Path(params.train.metrics_dir) / "sent.json")
    return summary


def main(argv: list[str] | None = None) -> int:
    return run_stage("sent", sent, (SentConfig, ModelConfig, DecodeConfig, OtherStagesTrainKeys), argv)


if __name__ == "__main__":
    raise SystemExit(main())
