"""Produce golden vectors with z-lab's reference DFlash2DraftModel (dflash/model.py @ 07ebd93).

Run from /tmp/zlab_golden (outside the dflash2-trt repository):
    PYTHONPATH=/tmp/zlab_golden python make_golden.py OUT_DIR
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file as save_np
from transformers import Qwen3Config

from dflash import model as Z

OUT = Path(sys.argv[1])
V, H, K, BS = 128, 32, 16, 8

BASE = dict(vocab_size=V, hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, rms_norm_eps=1e-5, attention_dropout=0.0,
            num_target_layers=8, tie_word_embeddings=False)
DC = dict(block_size=BS, mask_token_id=V - 1, target_layer_ids=[1, 3, 5], conv_kernel_size=2, conv_group_size=16,
          selector_rank=16, selector_top_k=K)
VARIANTS = {
    # released-checkpoint layout (fixture): sliding layers with a long non-causal window, theta only in
    # rope_parameters, output multiplier + soft-cap
    "released": dict(num_hidden_layers=2, max_position_embeddings=4096, layer_types=["sliding_attention"] * 2, use_sliding_window=True,
                     sliding_window=2048, max_window_layers=2, is_causal=False,
                     rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
                     dflash=dict(output_multiplier=0.19611613513818404, final_logit_softcapping=20.0)),
    # window (5) shorter than the block (8), non-causal: rows ahead are hidden too; yarn RoPE; biases; gelu
    "window_yarn": dict(num_hidden_layers=1, max_position_embeddings=64, layer_types=["sliding_attention"], use_sliding_window=True,
                        sliding_window=5, max_window_layers=1, is_causal=False, attention_bias=True,
                        hidden_act="gelu_pytorch_tanh",
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 16},
                        dflash=dict(input_embedding_scale=1.5)),
    # sliding layer types with use_sliding_window false: causal, no window; llama3 RoPE
    "causal_llama3": dict(num_hidden_layers=1, max_position_embeddings=4096, layer_types=["sliding_attention"], use_sliding_window=False,
                          sliding_window=3, max_window_layers=1,
                          rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 16},
                          dflash=dict()),
}
SINGLE_CTX = (3, 9, 14, 21)  # context lengths of the single blocks (anchor position = context length)
BATCH, BATCH_CTX = 24, 5


class Target(torch.nn.Module):  # the target's embedding and LM head, all z-lab's generate reads from it
    def __init__(self, emb, head):
        super().__init__()
        self.embed = torch.nn.Embedding(V, H)
        self.lm_head = torch.nn.Linear(H, V, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(emb)
            self.lm_head.weight.copy_(head)

    def get_input_embeddings(self):
        return self.embed


def init(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "base_kernel" in name:
                p.zero_()
                p[:, 0] = 1.0
                p.add_(0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "codebook" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def lattice(model, g, cand, unary, anchor):
    """[L, K_prev, K_cur]: unary + <A[prev] * g_t, B[cand]> (z-lab's select() score, every predecessor)."""
    cs = model.candidate_selector
    L = cand.shape[0]
    out = torch.empty(L, K, K)
    for t in range(L):
        prev = anchor.expand(K) if t == 0 else cand[t - 1]
        out[t] = unary[t][None, :] + torch.einsum("pr,cr->pc", cs.predecessor_codebook(prev) * g[t],
                                                  cs.successor_codebook(cand[t]))
    return out


def run_block(model, target, feats, anchors):
    """feats [B, n, 3H], anchors [B] -> dict of z-lab's outputs for blocks at position n."""
    B, n = feats.shape[:2]
    ids = torch.full((B, BS), model.mask_token_id, dtype=torch.long)
    ids[:, 0] = anchors
    noise = Z._raw_input_embeddings(target, ids, float(Z._draft_value(model.config, "input_embedding_scale", 1.0)))
    pos = torch.arange(n + BS)[None].expand(B, -1)
    hidden = model(position_ids=pos, noise_embedding=noise, target_hidden=feats)  # [B, bs, H]
    rows = hidden[:, 1 - BS:, :]
    logits = model.compute_logits(rows, Z._output_head(target))  # [B, L, V]
    path, cand, _ = model.propose(rows, anchors, Z._output_head(target), 0.0)
    unary, cand2 = torch.topk(logits, K, dim=-1, sorted=False)  # the call select() makes
    assert torch.equal(cand, cand2)
    g = model.candidate_selector.hidden_projection(rows)
    lat = torch.stack([lattice(model, g[b], cand[b], unary[b], anchors[b]) for b in range(B)])
    return dict(hidden=hidden, logits=logits, unary=unary, cand=cand, lattice=lat, path=path)


torch.set_grad_enabled(False)
torch.manual_seed(0)
gen = torch.Generator().manual_seed(1234)
emb, head = torch.randn(V, H, generator=gen), torch.randn(V, H, generator=gen) * 0.5
target = Target(emb, head)
(OUT / "golden").mkdir(parents=True, exist_ok=True)
save_np({"embed_tokens.weight": emb.numpy(), "lm_head.weight": head.numpy()}, str(OUT / "target.safetensors"))
for vi, (name, spec) in enumerate(VARIANTS.items()):
    spec = dict(spec)
    dflash = {**DC, **spec.pop("dflash")}
    cfg = Qwen3Config(**BASE, **spec, dflash_config=dflash)
    cfg.architectures = ["DFlash2DraftModel"]
    model = Z.DFlash2DraftModel(cfg).float().eval()
    init(model, 100 + vi)
    model.save_pretrained(str(OUT / name), safe_serialization=True)  # z-lab's checkpoint format
    g = torch.Generator().manual_seed(200 + vi)
    data = {}
    for j, n in enumerate(SINGLE_CTX):
        feats = torch.randn(1, n, 3 * H, generator=g)
        anchor = torch.randint(0, V - 1, (1,), generator=g)
        out = run_block(model, target, feats, anchor)
        data[f"single{j}.context"] = feats[0]
        data[f"single{j}.anchor"] = anchor
        for k, v in out.items():
            data[f"single{j}.{k}"] = v[0]
    feats = torch.randn(BATCH, BATCH_CTX, 3 * H, generator=g)
    anchors = torch.randint(0, V - 1, (BATCH,), generator=g)
    out = run_block(model, target, feats, anchors)
    data["batch.context"], data["batch.anchor"] = feats, anchors
    for k in ("hidden", "unary", "cand", "path"):
        data[f"batch.{k}"] = out[k]
    save_np({k: v.contiguous().numpy() for k, v in data.items()}, str(OUT / "golden" / f"{name}.safetensors"))
    print(name, {k: tuple(v.shape) for k, v in data.items() if k.startswith("single0")})
