"""GRPO's mathematics, as components with no knowledge of params files or models on disk.

    rewards.py               extract_answer(), the pure reward functions, their registry
    loss.py                  group_advantages(), grpo_loss(), the policy losses and aggregations (built
                             once into ``LossSettings``)
    entropy.py               token entropy, the entropy threshold and the token rules (objects of their options)
    logprobs.py, kernels/    chunked log-probs and entropies; the fused Triton kernels with their
                             PyTorch references
    curriculum.py            the orders of training rows (SENT's easy -> hard, its reverse, shuffled)
    stats.py                 paired tests, Holm's correction, power and intervals of the grids

May import: grpo.core.
"""
