#!/usr/bin/env python3
"""The recall task and train-demo's model, in PyTorch: shows that a 2-layer pre-LN Transformer
with learned positions sits on a plateau on multi-query associative recall (it answers by
elimination, about 38% of queries) for thousands of steps, and that a previous-token embedding
(train-demo's --token-shift, on by default for recall) removes the plateau.

    python mqar_plateau.py [D_MODEL] [LR] [STEPS] [perm|repl]     # env: P, V, H, LAYERS, SHIFT=1

Measured with torch 2.15.0, 1 thread, d_model 64, lr 1e-3, batch 64 (token accuracy on the
queries; chance 1/32):
- 8 pairs, vocabulary 64, keys queried once each (perm): 2000 steps, ~38-39% (as train-demo).
- the same with keys queried with replacement (repl): 2000 steps ~20%; 4 pairs, vocabulary 32:
  12000 steps, ~33%; d_model 128 or lr 3e-3 / 1e-2: no change.
- SHIFT=1: 100% by step 200.
"""
import sys, time, torch, torch.nn as nn, random
torch.manual_seed(0); random.seed(0)
torch.set_num_threads(1)
import os
P, V = int(os.environ.get("P", 8)), int(os.environ.get("V", 64))
D, H, LAYERS = int(sys.argv[1]) if len(sys.argv) > 1 else 64, int(os.environ.get("H", 2)), int(os.environ.get("LAYERS", 2))
LR = float(sys.argv[2]) if len(sys.argv) > 2 else 1e-3
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
SHIFT = os.environ.get('SHIFT') == '1'
REPL = (sys.argv[4] if len(sys.argv) > 4 else "perm") == "repl"
def sample():
    half = V // 2
    keys = random.sample(range(half), P)
    vals = [half + random.randrange(half) for _ in range(P)]
    order = [random.randrange(P) for _ in range(P)] if REPL else random.sample(range(P), P)
    seq = []
    for k, v in zip(keys, vals): seq += [k, v]
    for i in order: seq += [keys[i], vals[i]]
    tgt = [seq[i+1] if (i >= 2*P and (i-2*P) % 2 == 0) else -100 for i in range(len(seq)-1)]
    return seq[:-1], tgt
class Block(nn.Module):
    def __init__(s):
        super().__init__(); s.n1 = nn.LayerNorm(D); s.att = nn.MultiheadAttention(D, H, batch_first=True); s.n2 = nn.LayerNorm(D)
        s.mlp = nn.Sequential(nn.Linear(D, 4*D), nn.GELU(), nn.Linear(4*D, D))
    def forward(s, x, mask):
        h = s.n1(x); x = x + s.att(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + s.mlp(s.n2(x))
class M(nn.Module):
    def __init__(s):
        super().__init__(); s.tok = nn.Embedding(V, D); s.pos = nn.Embedding(4*P, D); s.prev = nn.Embedding(V + 1, D); nn.init.normal_(s.prev.weight, std=0.02)
        nn.init.normal_(s.tok.weight, std=0.02); nn.init.normal_(s.pos.weight, std=0.02)
        s.blocks = nn.ModuleList([Block() for _ in range(LAYERS)]); s.n = nn.LayerNorm(D); s.head = nn.Linear(D, V)
    def forward(s, t):
        L = t.shape[1]; x = s.tok(t) + s.pos(torch.arange(L))
        if SHIFT: x = x + s.prev(torch.cat([torch.full_like(t[:, :1], V), t[:, :-1]], 1))
        mask = torch.triu(torch.ones(L, L, dtype=torch.bool), 1)
        for b in s.blocks: x = b(x, mask)
        return s.head(s.n(x))
m = M(); opt = torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.01)
t0 = time.time()
for step in range(1, STEPS+1):
    warm = 100
    lr = LR * step / warm if step < warm else LR * (0.05 + 0.95 * 0.5 * (1 + __import__('math').cos(3.14159 * (step - warm) / (STEPS - warm))))
    for g in opt.param_groups: g['lr'] = lr
    b = [sample() for _ in range(64)]
    x = torch.tensor([s for s, _ in b]); y = torch.tensor([t for _, t in b])
    loss = nn.functional.cross_entropy(m(x).reshape(-1, V), y.reshape(-1), ignore_index=-100)
    opt.zero_grad(); loss.backward(); nn.utils.clip_grad_norm_(m.parameters(), 1.0); opt.step()
    if step % 200 == 0:
        with torch.no_grad():
            b = [sample() for _ in range(512)]
            x = torch.tensor([s for s, _ in b]); y = torch.tensor([t for _, t in b])
            p = m(x).argmax(-1); ok = (y != -100)
            acc = ((p == y) & ok).sum().item() / ok.sum().item()
        print(f"step {step} loss {loss.item():.3f} acc {acc:.3f} t {time.time()-t0:.0f}s", flush=True)
