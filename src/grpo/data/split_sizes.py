"""How many rows each split of a data source can hold, and which asked sizes it cannot give.

``supply(cfg, root)`` says the most rows each split (train, test, val) of ``data.source`` can hold
and where they come from:

- ``gsm8k``: the hub's row counts (``grpo.data.sources.GSM8K_ROWS``); GSM8K has no validation split, so
  ``prepare_data`` carves it from the train split: the ``val_size`` rows after the first
  ``train_size`` (``grpo.data.sources._listed_splits``).
- ``jsonl``: the valid rows of ``data.path`` (a missing file is a ``DataError`` naming it), cut as
  ``prepare_data`` cuts them: ``test_size`` rows, then at most ``train_size``, then at most
  ``val_size`` of the rest (train and val are "at most" by that contract: refused only when empty).
- ``arithmetic``: counted as the generator draws: every operand multiset of ``min_terms`` to
  ``max_terms`` operands in the operand range belongs to one split (``grpo.data.sources.split_of``), and
  gives one question per distinct ordering of its operands, operator sequence whose value exists
  (``grpo.data.arithmetic.evaluate``: exact division) and phrasing (``grpo.data.arithmetic.TEMPLATES``). A
  space of more than ``COUNT_LIMIT`` multisets (or expressions, with ``/``) is not counted (no bound).
- ``gsm_symbolic``: reasoning-gym's templates each split owns (``split_of`` of the template
  index); a template makes problems without a known bound, so a split is bounded only when it owns
  none (0 rows).

These are upper bounds for the generated sources: the draw (``grpo.data.sources.held_out_by_content``) may
stop short of one (``DRAWS_PER_ROW``), so ``prepare_data`` also checks the rows it drew.

``data_refusals(cfg, supply)`` gives one line per split asked more rows than its supply holds,
naming ``data.<split>_size``: ``grpo check`` (``grpo.data.split_check``) and ``prepare_data`` (before it
loads or draws, and on the rows a generator drew) call it.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from grpo.core.jsonio import DataError
from grpo.data import arithmetic
from grpo.data.sources import GSM8K_ROWS, load_user_jsonl, split_of

SPLITS = ("train", "test", "val")
NAMES = {"train": "training", "test": "test", "val": "validation"}
COUNT_LIMIT = 200_000
"""The most operand multisets (or, with ``/``, expressions) the arithmetic count enumerates."""


@dataclass(frozen=True)
class Supply:
    """The most rows each split can hold (None: no bound known), per split where they come from."""

    rows: dict[str, int | None]
    where: dict[str, str]
    at_most: frozenset[str] = frozenset()
    """The splits whose asked size is a most by the source's contract (jsonl's train and val: at
    most that many of the rest): refused only when empty."""


# ------------------------------------------------------------------------------ each source's sizes
def gsm8k_supply(cfg) -> Supply:
    """GSM8K's train and test splits; validation carved from train after ``train_size`` rows."""
    train, test = GSM8K_ROWS["train"], GSM8K_ROWS["test"]
    used = min(cfg.train_size, train)
    left = train - used
    val_where = (f"GSM8K's train split after its first {used} rows (data.train_size), rows {used}-"
                 f"{used + min(cfg.val_size, left) - 1}" if left and cfg.val_size else
                 f"GSM8K's train split ({train} rows) after data.train_size {cfg.train_size}")
    return Supply({"train": train, "test": test, "val": left},
                  {"train": f"GSM8K's train split ({train} rows), rows 0-{used - 1}",
                   "test": f"GSM8K's test split ({test} rows)", "val": val_where})


def jsonl_supply(cfg, root: Path) -> Supply:
    """The valid rows of ``data.path`` (relative to ``root``), cut test, then train, then val."""
    path = Path(cfg.path) if Path(cfg.path).is_absolute() else root / cfg.path
    rows, _ = load_user_jsonl(path)
    n = len(rows)
    train_left = max(0, n - cfg.test_size)
    val_left = max(0, train_left - cfg.train_size)
    return Supply({"train": train_left, "test": n, "val": val_left},
                  {"train": f"{cfg.path} ({n} valid rows) less data.test_size {cfg.test_size}",
                   "test": f"{cfg.path} ({n} valid rows)",
                   "val": f"{cfg.path} ({n} valid rows) less data.test_size {cfg.test_size} and data.train_size "
                          f"{cfg.train_size}"}, frozenset({"train", "val"}))


def expressions_of(operands: tuple[int, ...], operators: list[str]) -> int:
    """Distinct expressions (operand orderings x operator sequences) of the multiset ``operands``
    that have a value (``arithmetic.evaluate``; only ``/`` can fail). Without ``/`` by formula:
    ``t! / prod(count!) x |operators|^(t - 1)``; with it by enumeration."""
    t = len(operands)
    if "/" not in operators:
        orderings = math.factorial(t) // math.prod(math.factorial(c) for c in Counter(operands).values())
        return orderings * len(operators) ** (t - 1)
    count = 0
    for order in set(itertools.permutations(operands)):
        for ops in itertools.product(operators, repeat=t - 1):
            try:
                arithmetic.evaluate(arithmetic.Expression(order, ops))
            except arithmetic.ExpressionError:
                continue
            count += 1
    return count


def arithmetic_supply(cfg) -> Supply:
    """Questions per split of the generator's space (module docstring); no bound above ``COUNT_LIMIT``."""
    operators = sorted(set(cfg.operators))
    terms = range(cfg.min_terms, cfg.max_terms + 1)
    top = 10 ** cfg.max_digits  # operands lie below it (grpo.data.arithmetic: max_digits digits at most)
    work = sum(math.comb(top + t - 1, t) * (math.factorial(t) * len(operators) ** (t - 1) if "/" in operators else 1)
               for t in terms)
    if work > COUNT_LIMIT:
        where = f"the generator's space (more than {COUNT_LIMIT:,} operand multisets: not counted)"
        return Supply(dict.fromkeys(SPLITS), dict.fromkeys(SPLITS, where))
    values = [v for v in range(top) if arithmetic._in_range(v, cfg.min_digits, cfg.max_digits)]
    questions, keys = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0)
    for t in terms:
        for operands in itertools.combinations_with_replacement(values, t):  # sorted: the operand_set key
            n = expressions_of(operands, operators)
            if n:
                split = split_of(operands, cfg.seed)
                questions[split] += n * len(arithmetic.TEMPLATES)
                keys[split] += 1
    return Supply(questions, {s: f"the generator's {questions[s]} distinct questions of the {keys[s]} operand multisets "
                                 f"this split owns" for s in SPLITS})


def gsm_symbolic_supply(cfg) -> Supply:
    """reasoning-gym's templates each split owns: 0 rows without one, else no bound."""
    from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import tasks_ok

    owned = Counter(split_of(t, cfg.seed) for t in tasks_ok)
    return Supply({s: None if owned[s] else 0 for s in SPLITS},
                  {s: f"{owned[s]} of reasoning-gym's {len(tasks_ok)} gsm_symbolic templates" for s in SPLITS})


def supply(cfg, root: str | Path = ".") -> Supply:
    """The most rows each split of the data section ``cfg``'s source can hold (module docstring)."""
    if cfg.source == "gsm8k":
        return gsm8k_supply(cfg)
    if cfg.source == "jsonl":
        return jsonl_supply(cfg, Path(root))
    if cfg.source == "arithmetic":
        return arithmetic_supply(cfg)
    return gsm_symbolic_supply(cfg)


def drawn_supply(stats: dict) -> Supply:
    """The rows ``grpo.data.sources.prepare_splits`` drew (its ``stats``), as a supply."""
    return Supply({s: stats[s] for s in SPLITS}, dict.fromkeys(SPLITS, f"{stats['source']}'s draw"))


# ------------------------------------------------------------------------------ the refusals
def asked(cfg) -> dict[str, int]:
    return {"train": cfg.train_size, "test": cfg.test_size, "val": cfg.val_size}


def data_refusals(cfg, found: Supply) -> list[str]:
    """One line per split asked more rows than ``found`` holds (of an ``at_most`` split: none)."""
    out = []
    for split, n in asked(cfg).items():
        have = found.rows[split]
        if n and have is not None and (have == 0 or (have < n and split not in found.at_most)):
            there = "none" if have == 0 else f"only {have}"
            out.append(f"data.{split}_size: {n} {NAMES[split]} rows asked, but there are {there}: {found.where[split]}")
    return out


def expected_rows(cfg, found: Supply) -> dict[str, int | None]:
    """The rows each split ``prepare_data`` would write: the asked size, capped by the supply."""
    return {s: n if found.rows[s] is None else min(n, found.rows[s]) for s, n in asked(cfg).items()}


def refuse(lines: list[str]) -> None:
    """``DataError`` of ``lines`` in one line (nothing when empty)."""
    if lines:
        raise DataError("; ".join(lines))
