#!/usr/bin/env python3
"""PyTorch's nn.MultiheadAttention on CPU, in the table format of `cargo bench --workspace --bench table`.

    python crates/mha/benches/torch_mha.py                      # every shape, threads = cores
    python crates/mha/benches/torch_mha.py --threads 2 --shapes 4x512x512x8

Modes match the Rust bench: `fwd` (eval, inference mode, need_weights=False: PyTorch's fast
path), `fwd+weights` (per-head weights, average_attn_weights=False) and `fwd+bwd` (gradient of
sum(out²) with respect to the input and every parameter). Each call reads back the sum of the
output and, with weights, one element of them. Median of >=3 runs after a warm-up;
GFLOP/s counts the four projections and the two attention matmuls (x3 for fwd+bwd).
"""
import argparse
import os
import statistics
import time

import torch

SHAPES = ["8x128x256x8", "4x512x512x8", "1x2048x512x8", "1x8192x512x8"]


def forward_flops(b, l, e):
    return 2.0 * (4.0 * b * l * e * e + 2.0 * b * l * l * e)


def median_ms(budget_s, fn):
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 15):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--modes", default="fwd,fwd+weights,fwd+bwd")
    parser.add_argument("--budget-s", type=float, default=3.0)
    # The inputs' standard deviation, as the Rust bench's --input-std (12: a sharp softmax).
    parser.add_argument("--input-std", type=float, default=1.0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__} | threads: {torch.get_num_threads()} | "
          f"inputs' deviation {args.input_std} | median of >=3 runs "
          "after a warm-up | GFLOP/s over the module's matmuls\n")
    print("| device | batch, seq, d_model, heads | mode | PyTorch ms | PyTorch GFLOP/s |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        b, l, e, h = (int(n) for n in shape.split("x"))
        mha = torch.nn.MultiheadAttention(e, h, batch_first=True)
        x = torch.randn(b, l, e) * args.input_std
        for mode in args.modes.split(","):
            if mode == "fwd":
                mha.eval()

                def run():
                    with torch.inference_mode():
                        return mha(x, x, x, need_weights=False)[0].sum().item()
            elif mode == "fwd+weights":
                mha.eval()

                def run():
                    with torch.inference_mode():
                        out, weights = mha(x, x, x, need_weights=True, average_attn_weights=False)
                        # One element, as the Rust bench reads: not the reduction's time.
                        return out.sum().item() + weights[0, 0, 0, 0].item()
            elif mode == "fwd+bwd":
                mha.train()

                def run():
                    mha.zero_grad(set_to_none=True)
                    xg = x.clone().requires_grad_(True)
                    out = mha(xg, xg, xg, need_weights=False)[0]
                    out.pow(2).sum().backward()
                    return xg.grad.sum().item() + mha.out_proj.weight.grad.sum().item()
            else:
                raise SystemExit(f"--modes: unknown mode {mode}")
            ms = median_ms(args.budget_s, run)
            flops = forward_flops(b, l, e) * (3.0 if mode == "fwd+bwd" else 1.0)
            print(f"| cpu | {b}, {l}, {e}, {h} | {mode} | {ms:.1f} | {flops / ms / 1e6:.1f} |",
                  flush=True)


if __name__ == "__main__":
    main()
