"""The fused Triton entropy + log-prob kernel against its PyTorch reference: error, time, memory.

For R rows of bf16 logits over V tokens (default: 8 x 512 completion positions of seed 003's
step, V = 151,936, Qwen2's vocabulary), both paths compute the per-row entropy and the target
token's log-prob. Printed: the largest absolute difference of each output (bf16 inputs, fp32
math in both, so they should agree to ~1e-3), the median time over ``--repeat`` calls (CUDA
events), and the peak extra memory above the logits (``max_memory_allocated`` growth): the
reference holds an fp32 copy of the logits and one more (R, V) fp32 temporary; the kernel
streams each row through registers and writes two floats.

    python bench/entropy_kernel.py                     # CUDA, 4096 x 151936
    python bench/entropy_kernel.py --json out.json     # also write the figures to a file
    TRITON_INTERPRET=1 python bench/entropy_kernel.py --rows 8 --vocab 4096   # CPU check (slow)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from grpo.device import default_device  # noqa: E402
from grpo.kernels.entropy_logprob import entropy_logprob_torch, entropy_logprob_triton, triton_available  # noqa: E402


def _measure(fn, logits, targets, repeat: int) -> dict:
    cuda = logits.is_cuda
    fn(logits, targets)  # compile / warm up
    times = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(logits, targets)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        else:
            t0 = time.perf_counter()
            out = fn(logits, targets)
            times.append(time.perf_counter() - t0)
            peak = float("nan")
    return {"out": out, "seconds": statistics.median(times), "peak_extra_mb": peak}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--json", help="also write the figures (the last printed line) to this file")
    args = ap.parse_args()
    device = default_device()
    if not triton_available(device):
        sys.exit("the Triton kernel needs CUDA, or TRITON_INTERPRET=1 on the CPU")
    torch.manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, device=device) * 3).to(torch.bfloat16)  # (R, V)
    targets = torch.randint(0, args.vocab, (args.rows,), device=device)  # (R,)
    ref = _measure(entropy_logprob_torch, logits, targets, args.repeat)
    tri = _measure(entropy_logprob_triton, logits, targets, args.repeat)
    err_h = (ref["out"][0] - tri["out"][0]).abs().max().item()
    err_l = (ref["out"][1] - tri["out"][1]).abs().max().item()
    print(f"{device}: {args.rows} rows x vocab {args.vocab}, bf16 logits ({logits.numel() * 2 / 2**20:.0f} MB)")
    print(f"max |entropy diff| {err_h:.2e}, max |logp diff| {err_l:.2e}")
    print(f"{'path':<8} {'median s':>10} {'peak extra MB':>14}")
    for name, r in (("torch", ref), ("triton", tri)):
        print(f"{name:<8} {r['seconds']:10.5f} {r['peak_extra_mb']:14.1f}")
    figures = {"device": device, "rows": args.rows, "vocab": args.vocab, "max_entropy_diff": err_h,
               "max_logp_diff": err_l, "torch_s": ref["seconds"], "triton_s": tri["seconds"],
               "torch_peak_extra_mb": ref["peak_extra_mb"], "triton_peak_extra_mb": tri["peak_extra_mb"],
               "logits_mb": logits.numel() * 2 / 2**20}
    print(json.dumps(figures))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(figures, indent=1))
    if max(err_h, err_l) > 2e-2:
        sys.exit("kernel and reference disagree beyond bf16 tolerance")


if __name__ == "__main__":
    main()
