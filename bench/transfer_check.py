"""Does the trained adapter transfer beyond the project's own test split? A check kept outside the
pipeline: no stage reads it and nothing is chosen on it.

    python bench/transfer_check.py [--n 150] [--adapter models/adapter] [--json out.json]

Two probe sets, each problem asked of the base model and of base + adapter (greedy, the evaluation
stage's code: ``grpo.evaluation.evaluate.evaluate`` with ``evaluate.test_path`` pointed at the probe):

- ``other-wordings``: the params' operand shape, but only operand multisets that the held-out split
  gives to test (``grpo.data.sources.split_of``: never a training problem's operands), in phrasings the
  generator never uses, word problems among them.
- ``three-digit``: both operands of three digits (no training problem has one), plain phrasing.

Labels are computed by ``grpo.data.arithmetic`` from the expression the question states. Prints per set
the accuracy before and after with 95% Wilson intervals and the paired difference; needs
``models/base`` (``dvc repro``) and the adapter.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORDINGS = (
    "Add {a} and {b}.",
    "What is the sum of {a} and {b}?",
    "{name} has {a} {things} and gets {b} more. How many {things} does {name} have now?",
    "A box holds {a} {things}. Another holds {b}. How many {things} are there in both boxes?",
)
NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima")
THINGS = ("apples", "stamps", "marbles", "books", "coins")


def other_wordings(n: int, data, seed: int) -> list[dict]:
    """``n`` sums whose operand multisets belong to the test share of ``data``'s split, reworded."""
    from grpo.data.arithmetic import Expression, evaluate
    from grpo.data.sources import split_of

    rng, rows = random.Random(f"transfer:{seed}"), []
    while len(rows) < n:
        a, b = (rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)
                for d in (rng.randint(data.min_digits, data.max_digits) for _ in range(2)))
        if split_of((min(a, b), max(a, b)), data.seed) != "test":
            continue
        text = rng.choice(WORDINGS).format(a=a, b=b, name=rng.choice(NAMES), things=rng.choice(THINGS))
        rows.append({"id": f"wording-{len(rows)}", "question": text,
                     "answer": str(evaluate(Expression((a, b), ("+",)))), "solution": ""})
    return rows


def three_digit(n: int, seed: int) -> list[dict]:
    from grpo.data.arithmetic import Expression, evaluate

    rng = random.Random(f"three:{seed}")
    out = []
    for i in range(n):
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        out.append({"id": f"three-{i}", "question": f"What is {a} + {b}?",
                    "answer": str(evaluate(Expression((a, b), ("+",)))), "solution": ""})
    return out


def run_set(params, rows: list[dict], adapter: str, work: Path) -> dict:
    from grpo.core.jsonio import write_jsonl
    from grpo.evaluation.evaluate import evaluate, wilson_interval

    path = work / "probe.jsonl"
    write_jsonl(path, rows)
    p = params.model_copy(update={"evaluate": params.evaluate.model_copy(update={"test_path": str(path)})})
    out = {}
    for name, adapter_dir in (("before", None), ("after", adapter)):
        metrics, per_problem = evaluate(p, adapter_dir, work / name)
        k = sum(r["correct"] for r in per_problem)
        out[name] = {"accuracy": metrics["accuracy"], "ci95": wilson_interval(k, len(per_problem)),
                     "correct": [bool(r["correct"]) for r in per_problem]}
    both = list(zip(out["before"]["correct"], out["after"]["correct"]))
    out["gained"], out["lost"] = sum(not b and a for b, a in both), sum(b and not a for b, a in both)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=150, help="problems per probe set")
    ap.add_argument("--adapter", default="models/adapter")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    from grpo.config.params import load_params

    params = load_params(args.params)
    sets = {"other-wordings": other_wordings(args.n, params.data, params.data.seed),
            "three-digit": three_digit(args.n, params.data.seed)}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, rows in sets.items():
            results[name] = run_set(params, rows, args.adapter, Path(tmp) / name)
    for name, r in results.items():
        b, a = r["before"], r["after"]
        print(f"{name:<15} n={args.n}  before {b['accuracy']:.3f} [{b['ci95'][0]:.3f}, {b['ci95'][1]:.3f}]  "
              f"after {a['accuracy']:.3f} [{a['ci95'][0]:.3f}, {a['ci95'][1]:.3f}]  "
              f"gain {a['accuracy'] - b['accuracy']:+.3f} ({r['gained']} problems gained, {r['lost']} lost)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
