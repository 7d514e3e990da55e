"""Answer one question with the base model or base + trained LoRA adapter, as evaluation would.

The policy is the one final evaluation scores: ``grpo.model.lora_policy.export_dense`` writes the base as
training loads it (4-bit NF4 when ``model.quantization`` is ``nf4``) dequantised to dense weights,
with the adapter merged (``merge_and_unload``), into a temporary directory; that directory is
loaded in ``model.dtype`` (``auto``: ``grpo.core.device.compute_dtype``) like evaluation's transformers
backend. The prompt is ``grpo.data.sources.build_prompt`` with ``train.system_prompt``; decoding is greedy
(``model.generate``, whose greedy tokens equal ``grpo.rollout.sampling.decode``'s, tested there), stops at
the same EOS ids as the rollout backend and is capped at ``evaluate.max_new_tokens`` unless told
otherwise. The text is streamed as it is generated; the final answer is ``extract_answer`` of it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TextIO

from grpo.core.device import default_device
from grpo.core.errors import ModelConfigError
from grpo.data.sources import build_prompt
from grpo.model.base_model import check_model_dir, load_tokenizer
from grpo.model.lora_policy import export_dense, load_base_model


def check_dirs(model_path: Path, adapter_dir: Path | None) -> None:
    """One line naming what is missing: the base model (``grpo.model.base_model.check_model_dir``) or
    the adapter directory."""
    check_model_dir(model_path)
    if adapter_dir is not None and not (adapter_dir / "adapter_config.json").is_file():
        raise ModelConfigError(f"--adapter: {adapter_dir}: no LoRA adapter there (no adapter_config.json; "
                               "run the train stage first)")


def load_for_answering(model_cfg, adapter_dir: Path | None):
    """``(model, tokenizer, how)``: the dense policy (adapter merged) that evaluation decodes."""
    with tempfile.TemporaryDirectory(prefix="grpo-ask-") as tmp:
        export = export_dense(model_cfg, adapter_dir, Path(tmp) / "weights")
        model = load_base_model(export["path"], model_cfg.dtype, default_device())
        tokenizer = load_tokenizer(export["path"])
    return model, tokenizer, export["weights"]


def eos_ids(model, tokenizer) -> list[int]:
    """The tokenizer's EOS and the generation config's, as ``grpo.rollout.rollout_backends.TransformersBackend`` stops."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = getattr(model.generation_config, "eos_token_id", None)
    ids.update([gen] if isinstance(gen, int) else (gen or []))
    return sorted(ids)


def answer(model, tokenizer, question: str, system_prompt: str, max_new_tokens: int,
           out: TextIO | None = None) -> str:
    """Greedy completion of ``question``'s prompt; each piece of text goes to ``out`` as it is made."""
    import torch
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False):
            if out is not None:
                out.write(text)
                out.flush()

    prompt = build_prompt(tokenizer, question, system_prompt)
    enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).to(model.device)
    streamer = Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    with torch.no_grad():
        ids = model.generate(**enc, do_sample=False, temperature=None, top_p=None, top_k=None,
                             max_new_tokens=max_new_tokens, eos_token_id=eos_ids(model, tokenizer),
                             pad_token_id=tokenizer.pad_token_id, streamer=streamer)
    return tokenizer.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
