"""Everything that starts or feeds a vLLM engine.

    args.py          ONE builder of the engine's ``LLM(...)`` arguments (``engine_args``), from the
                     params, the device and the step's bounds; every engine and ``grpo check`` use it
    bounds.py        the step's generation calls and what bounds the engine for them (sequences,
                     batched tokens, a CPU engine's KV cache); pure arithmetic
    sampler.py       ``VLLMSampler``: samples a model saved in Hugging Face format (SENT, evaluation)
    forms.py         how the policy reaches the train engine (``dense`` | ``nf4``), chosen once
                     (``choose_form``), and which backend each training process runs
    dense_form.py    the ``dense`` sync: merged ``W + s B A`` written into the engine's layers
    nf4_form.py      the ``nf4`` engine: a vLLM quantization method computing with the trainer's own
                     4-bit layers, embedding and head (shared, not copied)
    adapter.py       the ``nf4`` engine's sync: the policy's LoRA adapter loaded under a new id each step
    policy_engine.py ``PolicyEngine``: the engine that holds the policy during training (start, sync
                     through one of the two strategies, sleep, wake-up, close) and ``policy_rollouts``,
                     the factory of the trainer's rollout backend
    preflight.py     ``grpo doctor``: what a GPU machine needs before the first engine starts

SENT and the evaluations import only ``sampler``, ``args`` and ``bounds`` (their DVC deps say so);
the training engine's modules are the train stage's alone. Pointers into vLLM's source for each
topic: docs/gpu-notes.md#vllm-source-map.
"""
