"""Problem rows, offline generators and prompt building.

A problem row is ``{"id", "question", "answer", "solution"}``: ``answer`` is the final number as
text, ``solution`` the worked solution when the source has one (else ``""``).
``build_prompt`` is the one place a question becomes model input; rollouts, SENT and
evaluation all call it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from collections.abc import Iterable, Iterator
from pathlib import Path

from grpo.algorithm.rewards import extract_answer
from grpo.core.jsonio import DataError, text_lines
from grpo.data import arithmetic

log = logging.getLogger(__name__)


SHARES = (("train", 0.5), ("test", 0.25), ("val", 0.25))
"""The share of the content keys (operand sets, word-problem templates) each split owns. Fixed, not
taken from the sizes, so that adding a validation split changes neither train nor test."""
DRAWS_PER_ROW = 20
"""A held-out split draws at most this many items per requested row before it stops short."""


def split_of(key: object, seed: int) -> str:
    """The split that owns the content ``key``: a hash of ``(seed, key)`` read as a uniform number
    in [0, 1) and cut by ``SHARES``. The same key always lands in the same split."""
    u = int.from_bytes(hashlib.sha256(f"{seed}:{key!r}".encode()).digest()[:8], "big") / 2**64
    cut = 0.0
    for name, share in SHARES:
        cut += share
        if u < cut:
            return name
    return SHARES[-1][0]


def held_out_by_content(items: Iterable[tuple[dict, object]], sizes: dict[str, int], seed: int
                        ) -> tuple[dict[str, list[dict]], int]:
    """Route a stream of ``(row, content key)`` to the split that owns each key until every split
    has its size (or ``DRAWS_PER_ROW`` items per requested row were drawn). A repeated question is
    skipped. Returns ``{split: rows}`` (ids ``<split>-<seed>-<k>``) and the items drawn. No key is
    in two splits, so test and validation share no content with training or with each other."""
    out: dict[str, list[dict]] = {name: [] for name, _ in SHARES}
    seen: set[str] = set()
    budget, drawn = DRAWS_PER_ROW * max(sum(sizes.values()), 1), 0
    for row, key in items:
        if drawn >= budget or all(len(out[s]) >= sizes[s] for s in out):
            break
        drawn += 1
        split = split_of(key, seed)
        if len(out[split]) < sizes[split] and row["question"] not in seen:
            seen.add(row["question"])
            out[split].append({**row, "id": f"{split}-{seed}-{len(out[split])}"})
    return out, drawn


def arithmetic_items(cfg) -> Iterator[tuple[dict, tuple[int, ...]]]:
    """Generated arithmetic rows (``grpo.data.arithmetic``) keyed by their operand multiset."""
    for question, answer, expr in arithmetic.generate(
            cfg.seed, min_terms=cfg.min_terms, max_terms=cfg.max_terms, min_digits=cfg.min_digits,
            max_digits=cfg.max_digits, operators=tuple(cfg.operators)):
        yield {"id": "", "question": question, "answer": answer, "solution": ""}, expr.operand_set


def generate_arithmetic(n: int, seed: int, *, min_terms: int = 2, max_terms: int = 2, min_digits: int = 1,
                        max_digits: int = 1, operators: tuple[str, ...] = ("+",), prefix: str = "arith") -> list[dict]:
    """``n`` generated arithmetic rows in one list (benchmarks and tests; no held-out split)."""
    stream = arithmetic.generate(seed, min_terms=min_terms, max_terms=max_terms, min_digits=min_digits,
                                 max_digits=max_digits, operators=tuple(operators))
    return [{"id": f"{prefix}-{seed}-{i}", "question": q, "answer": a, "solution": ""}
            for i, (q, a, _) in zip(range(n), stream)]


def gsm_symbolic_items(cfg, n: int) -> Iterator[tuple[dict, int]]:
    """GSM8K-derived word problems from reasoning-gym's ``gsm_symbolic`` (worked solution kept),
    keyed by the template each was made from (reasoning-gym's ``task_indices``): the underlying
    problem, whatever its numbers."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset("gsm_symbolic", size=n, seed=cfg.seed, difficulty=cfg.difficulty)
    for i in range(n):
        item = ds[i]
        answer = extract_answer(str(item["answer"]))
        if answer is None:  # the generator always gives a number; guard the schema anyway
            continue
        solution = str((item.get("metadata") or {}).get("answer_cot") or "")
        yield {"id": "", "question": item["question"], "answer": answer, "solution": solution}, ds.task_indices[i]


def check_arithmetic_labels(rows: list[dict]) -> None:
    """``DataError`` on the first row whose label is not the value of the expression in its question
    (recomputed from the text by ``grpo.data.arithmetic``): a wrong label is an error, never a skipped row."""
    for row in rows:
        try:
            arithmetic.check_label(row["question"], row["answer"])
        except arithmetic.ExpressionError as err:
            raise DataError(f"data: row {row['id']}: {err}") from None


GSM8K_ID = "openai/gsm8k"
GSM8K_ROWS = {"train": 7473, "test": 1319}
"""The rows of GSM8K's splits (config ``main``; no validation split: ``_listed_splits`` carves one
from train, after the first ``data.train_size`` rows). ``grpo.data.split_sizes`` checks asked sizes against them."""
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


def _row_problem(item) -> str | None:
    """Why a parsed JSONL row is not a problem row (None when it is one)."""
    if not isinstance(item, dict):
        return "not a JSON object"
    question = item.get("question")
    if not isinstance(question, str) or not question.strip():
        return "no question" if question is None else "empty question"
    if "answer" not in item:
        return "no answer"
    if extract_answer(str(item["answer"])) is None:
        return f"answer {str(item['answer'])[:20]!r} is not a number"
    return None


def load_user_jsonl(path: str | Path) -> tuple[list[dict], list[str]]:
    """Valid rows of a user's JSONL file and why each other row was rejected (``"line 4: no
    answer"``, in file order). A row is valid when it is a JSON object with a non-empty
    ``question`` and an ``answer`` from which a number can be read (``"42"``, ``"#### 1,000"``);
    ``id`` and ``solution`` are kept when present. Bytes that are not UTF-8 are a ``DataError``
    (``grpo.core.jsonio.text_lines``)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.path: {path}: file not found")
    rows, rejected = [], []
    for lineno, line in text_lines(path):
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            rejected.append(f"line {lineno}: not JSON")
            continue
        problem = _row_problem(item)
        if problem:
            rejected.append(f"line {lineno}: {problem}")
            continue
        rows.append({"id": str(item.get("id", f"jsonl-{lineno}")), "question": item["question"],
                     "answer": extract_answer(str(item["answer"])), "solution": str(item.get("solution", ""))})
    if not rows:
        raise DataError(f"data.path: {path}: no valid rows ({len(rejected)} rejected: each needs a question and a "
                        f"numeric answer; {'; '.join(rejected[:SHOWN])})")
    return rows, rejected


SHOWN = 3
"""How many skipped rows a warning names (the rest are counted)."""


def skipped_line(path: str | Path, reasons: list[str]) -> str:
    """One line saying how many rows of ``path`` were skipped and why the first ``SHOWN`` were
    (``"x.jsonl: 3 rows skipped: line 4: no answer; line 9: not JSON; ..."``)."""
    more = f"; and {len(reasons) - SHOWN} more" if len(reasons) > SHOWN else ""
    rows = "row" if len(reasons) == 1 else "rows"
    return f"{path}: {len(reasons)} {rows} skipped: {'; '.join(reasons[:SHOWN])}{more}"


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


def operand_sets_shared(train: list[dict], test: list[dict], val: list[dict]) -> dict[str, int]:
    """How many operand multisets (read back from each arithmetic question's text) two splits share:
    ``{"train_test": n, "train_val": n, "test_val": n}``; all 0 for a held-out split."""
    def keys(rows):
        return {arithmetic.expression_in(r["question"]).operand_set for r in rows}

    tr, te, va = keys(train), keys(test), keys(val)
    return {"train_test": len(tr & te), "train_val": len(tr & va), "test_val": len(te & va)}


def _generated_splits(cfg) -> tuple[list[dict], list[dict], list[dict], dict]:
    """The generated sources, held out by content (``held_out_by_content``): arithmetic by operand
    multiset, gsm_symbolic by template."""
    sizes = {"train": cfg.train_size, "test": cfg.test_size, "val": cfg.val_size}
    if cfg.source == "arithmetic":
        items, key = arithmetic_items(cfg), "operand multiset"
    else:
        items, key = gsm_symbolic_items(cfg, DRAWS_PER_ROW * sum(sizes.values())), "template"
    out, drawn = held_out_by_content(items, sizes, cfg.seed)
    train, test, val = out["train"], out["test"], out["val"]
    stats = {"held_out_by": key, "items_drawn": drawn}
    if cfg.source == "arithmetic":
        check_arithmetic_labels(train + test + val)
        stats["operand_sets_shared"] = shared = operand_sets_shared(train, test, val)
        if any(shared.values()):  # held_out_by_content guarantees 0; a failure here is a bug, loudly
            raise DataError(f"data: splits share operand sets {shared}")
    return train, test, val, stats


def _listed_splits(cfg) -> tuple[list[dict], list[dict], list[dict], int]:
    """The hub's GSM8K or the user's JSONL: split by rows, then by question text."""
    rejected: list[str] = []
    if cfg.source == "gsm8k":
        pool = load_gsm8k("train", cfg.train_size + cfg.val_size)
        train, val, test = pool[: cfg.train_size], pool[cfg.train_size:], load_gsm8k("test", cfg.test_size)
    elif cfg.source == "jsonl":
        rows, rejected = load_user_jsonl(cfg.path)
        if rejected:
            log.warning(skipped_line(cfg.path, rejected))
        if len(rows) <= cfg.test_size:
            raise DataError(f"data.test_size: {cfg.path} has {len(rows)} valid rows, not more than test_size={cfg.test_size}")
        order = list(range(len(rows)))
        random.Random(cfg.seed).shuffle(order)
        test = [rows[i] for i in order[: cfg.test_size]]
        train = [rows[i] for i in order[cfg.test_size:]][: cfg.train_size]
        val = [rows[i] for i in order[cfg.test_size + cfg.train_size:]][: cfg.val_size]
    else:
        raise DataError(f"data.source: unknown source {cfg.source!r}")
    return train, test, val, len(rejected)


def prepare_splits(cfg) -> tuple[list[dict], list[dict], list[dict], dict]:
    """Train, test and validation rows for a ``DataConfig`` plus counts; no question is in two splits.

    Generated sources (``arithmetic``, ``gsm_symbolic``) are held out by content: each operand
    multiset or template belongs to one split (``split_of``), so test and validation problems are
    not training problems in other words; every arithmetic label is recomputed from its question's
    text and checked. Listed sources (``gsm8k``, ``jsonl``) are held out by question text only:
    their operands cannot be read reliably. Generators are seeded, so the same params give the same
    rows (and ``write_jsonl`` the same bytes); a validation split (``val_size``) changes neither
    train nor test.
    """
    if cfg.source in ("arithmetic", "gsm_symbolic"):
        train, test, val, extra = _generated_splits(cfg)
        rejected = 0
    else:
        train, test, val, rejected = _listed_splits(cfg)
        extra = {"held_out_by": "question text"}
    n_train = len(train)
    train, test, dropped = split_disjoint(train, test)
    if not train or not test:
        raise DataError(f"data: empty split after removing shared questions (train {len(train)}, test {len(test)})")
    n_val = len(val)
    val = unseen(val, {r["question"] for r in train + test})
    stats = {"source": cfg.source, "train": len(train), "test": len(test), "val": len(val),
             "train_duplicates_dropped": n_train - len(train), "test_dropped_shared_with_train": dropped,
             "val_dropped_seen_or_repeated": n_val - len(val), "rejected_rows": rejected, **extra}
    return train, test, val, stats


def build_prompt(tokenizer, question: str, system_prompt: str) -> str:
    """Model input text for ``question``: the chat template when the tokenizer has one, else a
    plain ``system / Question: / Answer:`` template."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system_prompt}\n\nQuestion: {question}\nAnswer:"


def sequence_positions(tokenizer, prompts: list[str], max_new_tokens: int) -> int:
    """The most tokens a sequence of ``prompts`` can hold: the longest prompt's tokens (as the
    samplers tokenize them: no special tokens added) plus ``max_new_tokens``."""
    longest = max((len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]), default=0)
    return longest + max_new_tokens


def prompts_that_fit(tokenizer, rows: list[dict], system_prompt: str, section, source: str | Path,
                     ) -> tuple[list[dict], list[str]]:
    """The rows whose prompt (``build_prompt``) plus ``section.max_new_tokens`` fits the engine's
    ``section.max_model_len`` tokens, and their prompts. The others are skipped with one WARNING
    (``skipped_line``: ``source``, each row's id and prompt length); when none fits, a
    ``DataError`` naming the key. A prompt of no more UTF-8 bytes than the budget fits without
    being tokenized (a tokenizer makes at most one token of each byte)."""
    budget = section.max_model_len - section.max_new_tokens
    kept, prompts, skipped = [], [], []
    for row in rows:
        prompt = build_prompt(tokenizer, row["question"], system_prompt)
        if len(prompt.encode()) > budget:
            n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
            if n > budget:
                skipped.append(f"id {row.get('id')!r}: prompt of {n} tokens + {section.max_new_tokens} new > "
                               f"{section.SECTION}.max_model_len {section.max_model_len}")
                continue
        kept.append(row)
        prompts.append(prompt)
    if skipped and not kept:
        raise DataError(f"{section.SECTION}.max_model_len: no prompt of {source} fits; "
                        + skipped_line(source, skipped))
    if skipped:
        log.warning(skipped_line(source, skipped))
    return kept, prompts
