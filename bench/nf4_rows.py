"""bitsandbytes' NF4 linear by row count: do M rows alone give the rows of a long call?

bitsandbytes 0.50.2 picks its CUDA NF4 path by the number of rows M (its backends/cuda/ops.py:
a fused matrix-vector kernel for few rows, dequantise + ``F.linear`` for many; docs/gpu-notes.md
cites the lines). The trainer's forwards are long (M = rows x tokens) and an engine's decode steps
short, so the same weights can give other numbers there. For each distinct linear shape of the
preset's architecture (q/o, k/v, gate/up, down at seed 003's Qwen2-1.5B), a ``Linear4bit`` (NF4,
double quantisation, bf16 compute, as ``grpo.model.lora_policy`` loads the base) computes the same first M
rows alone (M = 1, 4, 8, 16) and inside one M = 2048 call; it records whether they are equal, the
largest gap, and whether two calls at M give the same bits.

    python bench/nf4_rows.py [--arch qwen2-1.5b] [--json FILE]
    python bench/nf4_rows.py --dry-run     # the CPU at the toy architecture's shapes: checks the script
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SCHEMA = {
    "device": "str?: where it ran", "arch": "str?: the architecture whose shapes were used",
    "bitsandbytes": "str?: its version", "long_rows": "int?: the long call's M",
    "rows": "list[str]: per shape and M: shape in->out, M, equal, max |gap|, repeatable",
    "all_equal": "bool?: every short call equal to its rows of the long call",
    "all_repeatable": "bool?: every short call the same bits twice",
}
SHORT = (1, 4, 8, 16)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", default="qwen2-1.5b", help="an architecture of grpo.tools.synthetic.ARCHITECTURES")
    ap.add_argument("--long", type=int, default=2048, help="rows of the long call")
    ap.add_argument("--dry-run", action="store_true", help="the CPU, the toy architecture, a 64-row long call")
    ap.add_argument("--json", help="write the result here")
    return ap.parse_args(argv)


def linear_shapes(arch: str) -> dict[str, tuple[int, int]]:
    """(in, out) of each distinct linear of a transformer layer of ``arch`` (``grpo.core.model_shapes``),
    the linears of one shape named together: ``q_proj/o_proj``, ``k_proj/v_proj``, ..."""
    from grpo.core.model_shapes import model_shapes
    from grpo.tools.synthetic import architecture_config

    by_shape: dict[tuple[int, int], list[str]] = {}
    for x in model_shapes(architecture_config(arch)).layer_linears():
        by_shape.setdefault((x.in_features, x.out_features), []).append(x.leaf)
    return {"/".join(names): shape for shape, names in by_shape.items()}


def run(args) -> dict:
    import bitsandbytes as bnb
    import torch

    device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    arch, long = ("toy", 64) if args.dry_run else (args.arch, args.long)
    out = {"device": device, "arch": arch, "bitsandbytes": bnb.__version__, "long_rows": long, "rows": []}
    equal_all, repeat_all = True, True
    torch.manual_seed(0)
    for name, (d_in, d_out) in linear_shapes(arch).items():
        layer = bnb.nn.Linear4bit(d_in, d_out, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True,
                                  quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(torch.randn(d_out, d_in) * d_in**-0.5, requires_grad=False,
                                         quant_type="nf4", compress_statistics=True)
        layer = layer.to(device)  # quantises on the move, as a load does
        x = torch.randn(long, d_in, device=device, dtype=torch.bfloat16)  # (M_long, in)
        with torch.no_grad():
            full = layer(x)  # (M_long, out)
            for m in SHORT:
                a, b = layer(x[:m]), layer(x[:m])  # (m, out) each
                equal = torch.equal(a, full[:m])
                gap = (a.float() - full[:m].float()).abs().max().item()
                repeatable = torch.equal(a, b)
                equal_all &= equal
                repeat_all &= repeatable
                out["rows"].append(f"{name} {d_in}->{d_out}, M={m}: equal={equal}, max|gap|={gap:.3g}, "
                                   f"repeatable={repeatable}")
    out.update(all_equal=equal_all, all_repeatable=repeat_all)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    out = run(args)
    print(f"NF4 rows on {out['device']} (bitsandbytes {out['bitsandbytes']}, {out['arch']}), M alone vs "
          f"the same rows of M={out['long_rows']}:")
    for line in out["rows"]:
        print(f"  {line}")
    print(f"  all equal: {out['all_equal']}; all repeatable: {out['all_repeatable']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
