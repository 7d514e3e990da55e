"""Everything that starts or feeds a vLLM engine.

    args.py          ONE builder of the engine's ``LLM(...)`` arguments (``engine_args``), from the
                     params, the device and the step's bounds; every engine and ``grpo check`` use it
    bounds.py        the step's generation calls and what bounds the engine for them (sequences,
                     batched tokens, a CPU engine's KV cache); pure arithmetic
    sampler.py       ``VLLMSampler``: samples a model saved in Hugging Face format (SENT, evaluation)
    forms.py         the weights form: how the policy reaches the train engine; ``WeightsForm``, the
                     contract of a form class (its folder, engine options, start, sync, params rule,
                     memory), ``WEIGHTS_FORMS`` (``train.rollouts.engine_weights``), ``auto`` resolved
                     (``choose_form``), and which backend each training process runs
    forms_catalogue.py  every form's module imported: the registry with its entries
    dense_form.py    ``dense`` (``DenseForm``): a dense copy of the base, merged ``W + s B A`` written
                     into the engine's layers at each sync (``DenseSync``)
    nf4_form.py      ``nf4`` (``NF4Form``): a vLLM quantization method computing with the trainer's own
                     4-bit layers, embedding and head (shared, not copied)
    adapter.py       the ``nf4`` form's sync: the policy's LoRA adapter loaded under a new id each step
    needs.py         what an engine needs on CUDA (``EnginePlan``: the form's own needs, profile run,
                     KV cache) and the train engine's form for this machine (``form_here``)
    policy_engine.py ``PolicyEngine``: the engine that holds the policy during training (start, sync
                     through its weights form, sleep, wake-up, close) and ``policy_rollouts``,
                     the factory of the trainer's rollout backend
    preflight.py     ``grpo doctor``: what a GPU machine needs before the first engine starts

SENT and the evaluations import only ``sampler``, ``args`` and ``bounds`` (their DVC deps say so);
the training engine's modules are the train stage's alone. Adding a weights form:
docs/howto/add-a-weights-form.md. Pointers into vLLM's source for each
topic: docs/gpu-notes.md#vllm-source-map.
"""
