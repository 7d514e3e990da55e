"""Sampling completions: the decode loops, the rollout backends and every vLLM engine.

    sampling.py              decode(): each prompt prefilled once per group; the decode loops (DECODE_LOOPS)
    decode_memory.py         one decode call's predicted bytes, and the split of a call that does not fit
    rollout_backends.py      ONE rollout backend interface, the decode loop behind it, which backend samples
    semantic_entropy.py      the semantic entropy of a prompt's sampled answers (SENT)
    engine/                  everything vLLM (its own docstring lists its modules)

Components take the records and sections they are handed; none reads params. May import: grpo.core,
grpo.algorithm, grpo.data, grpo.model.
"""
