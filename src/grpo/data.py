"""Problem rows, offline generators and prompt building.

A problem row is ``{"id", "question", "answer", "solution"}``: ``answer`` is the final number as
text, ``solution`` the worked solution when the source has one (else ``""``).
``build_prompt`` is the one place a question becomes model input; rollouts, SENT and
evaluation all call it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from grpo.jsonio import DataError
from grpo.rewards import extract_answer


def generate_arithmetic(
    n: int,
    seed: int,
    *,
    min_terms: int = 2,
    max_terms: int = 2,
    min_digits: int = 1,
    max_digits: int = 1,
    operators: tuple[str, ...] = ("+",),
    prefix: str = "arith",
) -> list[dict]:
    """Easy arithmetic questions in natural phrasing from reasoning-gym's ``basic_arithmetic``."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset(
        "basic_arithmetic",
        size=n,
        seed=seed,
        min_terms=min_terms,
        max_terms=max_terms,
        min_digits=min_digits,
        max_digits=max_digits,
        operators=tuple(operators),
        allow_parentheses=False,
        allow_negation=False,
        format_style="natural",
    )
    return [
        {"id": f"{prefix}-{seed}-{i}", "question": item["question"], "answer": str(item["answer"]), "solution": ""}
        for i, item in enumerate(ds)
    ]


def generate_gsm_symbolic(n: int, seed: int, *, difficulty: float = 1.0, prefix: str = "gsm_symbolic") -> list[dict]:
    """GSM8K-derived word problems from reasoning-gym's ``gsm_symbolic`` (worked solution kept)."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset("gsm_symbolic", size=n, seed=seed, difficulty=difficulty)
    rows = []
    for i, item in enumerate(ds):
        answer = extract_answer(str(item["answer"]))
        if answer is None:  # the generator always gives a number; guard the schema anyway
            continue
        solution = str((item.get("metadata") or {}).get("answer_cot") or "")
        rows.append({"id": f"{prefix}-{seed}-{i}", "question": item["question"], "answer": answer, "solution": solution})
    return rows


GSM8K_ID = "openai/gsm8k"
OFFLINE_SOURCES = "gsm_symbolic, arithmetic or jsonl"


def load_gsm8k(split: str, n: int) -> list[dict]:
    """The first ``n`` rows of GSM8K (config ``main``) from the hub; the answer is the number after
    ``####``, the solution the text before it. Needs internet."""
    try:
        import datasets

        ds = datasets.load_dataset(GSM8K_ID, "main", split=split)
    except Exception as err:  # datasets raises many types for "no network"; all mean the same here
        raise DataError(
            f"data.source=gsm8k: cannot load {GSM8K_ID} from the Hugging Face hub ({type(err).__name__}); "
            f"offline, set data.source to one of {OFFLINE_SOURCES}"
        ) from err
    rows = []
    for i, item in enumerate(ds.select(range(min(n, len(ds))))):
        solution, _, final = item["answer"].rpartition("####")
        answer = extract_answer("#### " + final)
        if answer is not None:
            rows.append({"id": f"gsm8k-{split}-{i}", "question": item["question"], "answer": answer,
                         "solution": solution.strip()})
    return rows


def load_user_jsonl(path: str | Path) -> tuple[list[dict], int]:
    """Valid rows of a user's JSONL file and the number rejected. A row is valid when it is a JSON
    object with a non-empty ``question`` and an ``answer`` from which a number can be read
    (``"42"``, ``"#### 1,000"``); ``id`` and ``solution`` are kept when present."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.path: {path}: file not found")
    rows, rejected = [], 0
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                rejected += 1
                continue
            question = item.get("question") if isinstance(item, dict) else None
            answer = extract_answer(str(item.get("answer", ""))) if isinstance(item, dict) else None
            if not isinstance(question, str) or not question.strip() or answer is None:
                rejected += 1
                continue
            rows.append({"id": str(item.get("id", f"jsonl-{lineno}")), "question": question, "answer": answer,
                         "solution": str(item.get("solution", ""))})
    if not rows:
        raise DataError(f"data.path: {path}: no valid rows ({rejected} rejected: each needs a question and a numeric answer)")
    return rows, rejected


def unseen(rows: list[dict], seen: set[str]) -> list[dict]:
    """The rows whose question is not in ``seen`` and not repeated among them (first one kept)."""
    out, seen = [], set(seen)
    for r in rows:
        if r["question"] not in seen:
            seen.add(r["question"])
            out.append(r)
    return out


def split_disjoint(train: list[dict], test: list[dict]) -> tuple[list[dict], list[dict], int]:
    """Drop duplicate questions inside train, then test rows whose question is in train or
    earlier in test. Returns (train, test, number of test rows dropped)."""
    seen: set[str] = set()
    uniq = []
    for r in train:
        if r["question"] not in seen:
            seen.add(r["question"])
            uniq.append(r)
    kept = []
    for r in test:  # also drops repeats inside test: each question counts once
        if r["question"] not in seen:
            seen.add(r["question"])
            kept.append(r)
    return uniq, kept, len(test) - len(kept)


def prepare_splits(cfg) -> tuple[list[dict], list[dict], list[dict], dict]:
    """Train, test and validation rows for a ``DataConfig`` plus counts; no question is in two splits.

    Generators are seeded, so the same params give the same rows (and ``write_jsonl`` the same bytes).
    reasoning-gym seeds item i with ``seed + i``: the test split uses ``seed + 1_000_000``, the
    validation split ``seed + 2_000_000``. The validation split (``val_size`` drawn, rows seen in
    train or test dropped) is drawn after the other two, so adding it changes neither; ``gsm8k``
    takes it from the hub's train split after the training rows, ``jsonl`` from the rows after
    the test and train rows.
    """
    rejected = 0
    if cfg.source == "arithmetic":
        kw = dict(min_terms=cfg.min_terms, max_terms=cfg.max_terms, min_digits=cfg.min_digits,
                  max_digits=cfg.max_digits, operators=tuple(cfg.operators))
        train = generate_arithmetic(cfg.train_size, cfg.seed, prefix="train", **kw)
        test = generate_arithmetic(cfg.test_size, cfg.seed + 1_000_000, prefix="test", **kw)
        val = generate_arithmetic(cfg.val_size, cfg.seed + 2_000_000, prefix="val", **kw) if cfg.val_size else []
    elif cfg.source == "gsm_symbolic":
        train = generate_gsm_symbolic(cfg.train_size, cfg.seed, difficulty=cfg.difficulty, prefix="train")
        test = generate_gsm_symbolic(cfg.test_size, cfg.seed + 1_000_000, difficulty=cfg.difficulty, prefix="test")
        val = (generate_gsm_symbolic(cfg.val_size, cfg.seed + 2_000_000, difficulty=cfg.difficulty, prefix="val")
               if cfg.val_size else [])
    elif cfg.source == "gsm8k":
        pool = load_gsm8k("train", cfg.train_size + cfg.val_size)
        train, val, test = pool[: cfg.train_size], pool[cfg.train_size:], load_gsm8k("test", cfg.test_size)
    elif cfg.source == "jsonl":
        rows, rejected = load_user_jsonl(cfg.path)
        if len(rows) <= cfg.test_size:
            raise DataError(f"data.test_size: {cfg.path} has {len(rows)} valid rows, not more than test_size={cfg.test_size}")
        order = list(range(len(rows)))
        random.Random(cfg.seed).shuffle(order)
        test = [rows[i] for i in order[: cfg.test_size]]
        train = [rows[i] for i in order[cfg.test_size:]][: cfg.train_size]
        val = [rows[i] for i in order[cfg.test_size + cfg.train_size:]][: cfg.val_size]
    else:
        raise DataError(f"data.source: unknown source {cfg.source!r}")
    n_train = len(train)
    train, test, dropped = split_disjoint(train, test)
    if not train or not test:
        raise DataError(f"data: empty split after removing shared questions (train {len(train)}, test {len(test)})")
    n_val = len(val)
    val = unseen(val, {r["question"] for r in train + test})
    stats = {"source": cfg.source, "train": len(train), "test": len(test), "val": len(val),
             "train_duplicates_dropped": n_train - len(train), "test_dropped_shared_with_train": dropped,
             "val_dropped_seen_or_repeated": n_val - len(val), "rejected_rows": rejected}
    return train, test, val, stats


def build_prompt(tokenizer, question: str, system_prompt: str) -> str:
    """Model input text for ``question``: the chat template when the tokenizer has one, else a
    plain ``system / Question: / Answer:`` template."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system_prompt}\n\nQuestion: {question}\nAnswer:"
