"""Semantic entropy of sampled answers and the SENT curriculum (easy -> hard).

SENT (Cao et al., arXiv 2512.04359) orders training prompts by the *semantic entropy* of the
model's own answers: a prompt on which M samples agree on one final answer is easy; one whose
answers scatter over many values is hard. Training then runs from low to high entropy.

For one prompt with M sampled responses:

1. Cluster the responses by equivalent final answer: ``extract_answer`` normalises the number
   (``1,000`` and ``1000.00`` are one cluster). A response with no answer is a cluster of its own
   (it agrees with nothing, not even another unanswered response).
2. Cluster probabilities. ``likelihood`` estimator (as in semantic entropy, Kuhn et al. 2023):
   each response weighs ``exp(mean token log-prob)`` (length-normalised likelihood), the weights
   are normalised over the M responses, and a cluster's probability is the sum of its members'.
   ``count`` estimator (seed 003): a cluster's probability is its share of the M responses.
3. Entropy over clusters: ``H = -sum_c p_c log p_c`` (nats). All answers equal: 0; M distinct
   answers under ``count``: ``log M``.

Departure from the paper: clusters are formed by exact equality of the normalised final answer
instead of bidirectional entailment by an NLI model; for numeric math answers the two coincide
and ours needs no second model.

The sorted file is the input of the curriculum (``grpo.algorithm.curriculum``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from grpo.algorithm.rewards import correctness, extract_answer
from grpo.rollout.rollout_backends import generate_in_batches

ESTIMATORS = ("likelihood", "count")


def cluster_ids(answers: Sequence[str | None]) -> list[int]:
    """Cluster index per response: equal answers share an index; each ``None`` gets its own."""
    index: dict[str, int] = {}
    out = []
    next_id = 0
    for a in answers:
        if a is None:
            out.append(next_id)
            next_id += 1
        else:
            if a not in index:
                index[a] = next_id
                next_id += 1
            out.append(index[a])
    return out


def cluster_probs(answers: Sequence[str | None], seq_logprobs: Sequence[float] | None = None) -> list[float]:
    """Probability of each cluster (in order of first appearance).

    ``seq_logprobs``: length-normalised log-likelihood (mean token log-prob) of each response;
    ``None`` selects the count estimator.
    """
    if not answers:
        raise ValueError("semantic entropy needs at least one response")
    ids = cluster_ids(answers)
    if seq_logprobs is None:
        weights = [1.0] * len(ids)
    else:
        if len(seq_logprobs) != len(ids):
            raise ValueError(f"{len(ids)} answers but {len(seq_logprobs)} log-probs")
        top = max(seq_logprobs)  # shift before exp: only ratios matter
        weights = [math.exp(lp - top) for lp in seq_logprobs]
    total = sum(weights)
    probs = [0.0] * (max(ids) + 1)
    for cid, w in zip(ids, weights):
        probs[cid] += w / total
    return probs


def semantic_entropy(answers: list[str | None], seq_logprobs: list[float] | None = None) -> float:
    """Entropy (nats) over answer clusters; ``seq_logprobs=None`` uses the count estimator."""
    return -sum(p * math.log(p) for p in cluster_probs(answers, seq_logprobs) if p > 0)


def score_prompt(completions: list[str], mean_logprobs: list[float] | None, estimator: str, answer: str) -> dict:
    """SENT fields of one training row from its M sampled completions; ``pass_rate`` is the share
    of completions that the ``correctness`` reward scores as right (the same test as training)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    answers = [extract_answer(c) for c in completions]
    weights = mean_logprobs if estimator == "likelihood" else None
    counts: dict[str, int] = {}
    for a in answers:
        key = "none" if a is None else a
        counts[key] = counts.get(key, 0) + 1
    return {
        "semantic_entropy": semantic_entropy(answers, weights),
        "semantic_entropy_count": semantic_entropy(answers, None),
        "num_clusters": len(set(cluster_ids(answers))),
        "answer_counts": dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))),
        "pass_rate": sum(correctness(completions, [answer] * len(completions))) / len(completions),
    }


def score_rows(rows: list[dict], prompts: list[str], sampler, cfg, progress: bool = True) -> tuple[list[dict], dict]:
    """Sample ``cfg.num_samples`` answers per prompt with ``sampler`` (a ``RolloutBackend`` that
    returns log-probs), score each row and return (rows sorted easy -> hard, totals).

    Each output row is the input row plus ``semantic_entropy`` (the configured estimator),
    ``semantic_entropy_count``, ``num_clusters``, ``answer_counts`` and ``pass_rate`` (see
    ``score_prompt``).
    """
    m = cfg.num_samples
    scored, tokens = [], 0
    batches = generate_in_batches(sampler, prompts, m, batch_prompts=cfg.batch_prompts, progress=progress, desc="sent",
                                  max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p)
    for lo, roll in batches:
        batch = rows[lo:lo + len(roll.texts) // m]
        lengths = roll.completion_mask.sum(dim=1)  # (N,)
        tokens += int(lengths.sum())
        mean_lp = (roll.logprobs.sum(dim=1) / lengths.clamp(min=1)).tolist()  # (N,) length-normalised
        for i, row in enumerate(batch):
            texts = roll.texts[i * m:(i + 1) * m]
            fields = score_prompt(texts, mean_lp[i * m:(i + 1) * m], cfg.estimator, str(row["answer"]))
            scored.append({**row, **fields})
    return sort_by_entropy(scored), {"completions": len(rows) * m, "completion_tokens": tokens}


def sort_by_entropy(rows: list[dict]) -> list[dict]:
    """Rows ascending by ``semantic_entropy`` (stable: ties keep their input order)."""
    return sorted(rows, key=lambda r: r["semantic_entropy"])
