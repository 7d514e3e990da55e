"""Stage ``final_eval``: greedy accuracy of base + trained LoRA adapter (merged into dense weights) on the test split."""

from __future__ import annotations

from grpo.config.reading import Params
from grpo.config.sections.decode import DecodeConfig
from grpo.config.sections.evaluate_section import EvaluateConfig
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.shared import OtherStagesTrainKeys
from tasks._common import run_stage
from tasks._eval_stage import run_eval


def final_eval(params: Params) -> None:
    run_eval(params, "final", params.train.adapter_dir)


def main(argv: list[str] | None = None) -> int:
    return run_stage("final_eval", final_eval, (EvaluateConfig, ModelConfig, DecodeConfig, OtherStagesTrainKeys), argv)


if __name__ == "__main__":
    raise SystemExit(main())
