#!/usr/bin/env python3
"""PyTorch's causal training step at (1, 4096, 512, 8) on CPU, inputs of deviation 1 and 12: the
long_sequence bench's `feature-plain-4096` and `feature-peaked-4096` cases for
nn.MultiheadAttention (attn_mask with is_causal=True, loss mean(out²), three warm calls each).

    python crates/mha/benches/torch_causal_training.py --threads 2
"""
import argparse
import time

import torch


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    seq, d_model, heads = 4096, 512, 8
    mha = torch.nn.MultiheadAttention(d_model, heads, batch_first=True)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(seq)
    print(f"torch {torch.__version__} | threads: {torch.get_num_threads()}")
    for round_index in range(args.rounds):
        for deviation in (1.0, 12.0):
            x = (torch.randn(1, seq, d_model) * deviation).requires_grad_()
            times = []
            for _ in range(3):
                start = time.perf_counter()
                out = mha(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
                out.pow(2).mean().backward()
                times.append(time.perf_counter() - start)
                x.grad = None
            print(f"round {round_index}, deviation {deviation}: "
                  + ", ".join(f"{t:.3f}" for t in times) + " s")


if __name__ == "__main__":
    main()
