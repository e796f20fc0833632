"""The DFlash 2 drafter (docs/design.md) in PyTorch.

One forward pass drafts a whole block ``[anchor, MASK x L]`` conditioned on fused target features. This is
the one PyTorch forward: training calls it, and ``dflash2 export`` traces it (:mod:`dflash2_trt.export.
onnx_graphs` only wraps :meth:`DFlash2Drafter.context_kv` and :meth:`DFlash2Drafter.block_forward`).
The drafter owns no embedding or LM head: :meth:`DFlash2Drafter.bind_target` shares the target's frozen
token embedding [V, H] and LM head [V, H] (kept as non-persistent buffers, so they never enter a
drafter checkpoint).

Switches for ablations (``config.use_conv`` / ``config.use_selector``, or :meth:`set_ablation`): with the
convolutions off a layer is a DFlash v1 layer; with the selector off every row takes its own argmax
(DFlash v1 drafting).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from dflash2_trt.config import ARCH_V2, DFlash2Config
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.vocabulary import INDEPENDENT, SELECTOR_PRECISIONS
from dflash2_trt.model import selector as sel
from dflash2_trt.model.layers import MLP, POST, PRE, Attention, DynamicConv, RMSNorm, attention_biases, rope_tables


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DFlash2Config, with_conv: bool) -> None:
        super().__init__()
        H = cfg.hidden_size
        assert cfg.head_dim is not None
        self.self_attn = Attention(H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps,
                                   bias=cfg.attention_bias)
        self.mlp = MLP(H, cfg.intermediate_size, cfg.hidden_act)
        self.input_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(H, cfg.rms_norm_eps)
        if with_conv:
            self.attention_conv = DynamicConv(H, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = DynamicConv(H, cfg.conv_kernel_size, cfg.conv_group_size)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, ctx_bias: torch.Tensor, blk_bias: torch.Tensor, use_conv: bool
                ) -> torch.Tensor:
        """h [nb, bs, H] -> [nb, bs, H]; biases from :func:`~dflash2_trt.model.layers.attention_biases`."""
        x = self.input_layernorm(h)
        if use_conv:
            dyn = self.attention_conv.dynamic(x)  # [nb, bs, 2, kc, G] from the normed input
            x = self.attention_conv.mix(x, dyn, PRE)
        a = self.self_attn(x, cos, sin, ctx_k, ctx_v, ctx_bias, blk_bias)
        if use_conv:
            a = self.attention_conv.mix(a, dyn, POST)
        h = h + a
        x = self.post_attention_layernorm(h)
        if use_conv:
            dyn = self.mlp_conv.dynamic(x)
            x = self.mlp_conv.mix(x, dyn, PRE)
        m = self.mlp(x)
        if use_conv:
            m = self.mlp_conv.mix(m, dyn, POST)
        return h + m


_MIN_CONTEXT_CAPACITY = 64


@dataclass
class DraftContext:
    """Per-request draft context cache: per layer K/V of the fused context rows (positions 0..length-1).

    Invariant: the cache holds exactly the committed positions strictly before the current anchor.
    Rows live in per-layer buffers ``[1, kvh, capacity, d]`` that grow by doubling, so appending m rows
    costs O(m) amortised instead of re-copying the whole history every cycle; ``k`` / ``v`` are views of
    the filled part (valid until the next append that grows the buffer).
    """

    buf_k: list[torch.Tensor] = field(default_factory=list)  # per layer [1, kvh, capacity, d]
    buf_v: list[torch.Tensor] = field(default_factory=list)
    length: int = 0

    @property
    def capacity(self) -> int:
        return 0 if not self.buf_k else int(self.buf_k[0].shape[2])

    @property
    def k(self) -> list[torch.Tensor]:
        """Per layer [1, kvh, length, d] (views)."""
        return [b[:, :, : self.length] for b in self.buf_k]

    @property
    def v(self) -> list[torch.Tensor]:
        return [b[:, :, : self.length] for b in self.buf_v]

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append per-layer (k, v) [1, kvh, m, d] at the end."""
        m = int(kv[0][0].shape[2])
        need = self.length + m
        if need > self.capacity:
            cap = max(need, 2 * self.capacity, _MIN_CONTEXT_CAPACITY)

            def grown(old: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
                new = like.new_zeros(like.shape[0], like.shape[1], cap, like.shape[3])
                if old is not None:
                    new[:, :, : self.length] = old[:, :, : self.length]
                return new

            olds_k = self.buf_k or [None] * len(kv)
            olds_v = self.buf_v or [None] * len(kv)
            self.buf_k = [grown(o, k) for o, (k, _) in zip(olds_k, kv)]
            self.buf_v = [grown(o, v) for o, (_, v) in zip(olds_v, kv)]
        for bk, bv, (k, v) in zip(self.buf_k, self.buf_v, kv):
            bk[:, :, self.length : need] = k
            bv[:, :, self.length : need] = v
        self.length = need


@dataclass
class Draft:
    """One drafted block. L = bs - 1 rows."""

    tokens: torch.Tensor  # [nb, L] int64 chosen drafts
    proposal: torch.Tensor  # [nb, L, V] fp32 proposal q scattered into the vocab (for rejection sampling)
    cand: torch.Tensor  # [nb, L, K] int64 top-K candidates (K = 1 column of argmax without selector)
    logits: torch.Tensor  # [nb, L, V] fp32 drafter logits


class DFlash2Drafter(nn.Module):
    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        has_v2_parts = cfg.architecture == ARCH_V2
        self.fc = nn.Linear(cfg.context_in_features, H, bias=False)  # n*H_t -> H
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg, has_v2_parts) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        if has_v2_parts:
            self.candidate_selector = sel.CandidateSelector(H, cfg.selector_rank, cfg.vocab_size)
        if cfg.learned_mask_embedding:
            self.mask_embedding = nn.Parameter(torch.zeros(H))  # [H]
        self.use_conv = cfg.use_conv and has_v2_parts
        self.use_selector = cfg.use_selector and has_v2_parts
        # "fp32" (default, the reference) or "bf16": z-lab's vLLM rounding of the pair term (selector.lattice)
        self.selector_precision = SELECTOR_PRECISIONS[0]
        self.register_buffer("mask_ids", torch.full((1, cfg.num_draft_rows), cfg.mask_token_id, dtype=torch.long),
                             persistent=False)  # [1, L]
        # shared, frozen target tensors (never saved with the drafter)
        self.register_buffer("embed_weight", torch.zeros(0), persistent=False)  # [V, H] once bound
        self.register_buffer("lm_head_weight", torch.zeros(0), persistent=False)  # [V, H] once bound
        # draft vocabulary (restrict_vocab): the token ids the head may propose and their LM-head rows
        self.register_buffer("draft_vocab", torch.zeros(0, dtype=torch.long), persistent=False)  # [N]
        self.register_buffer("draft_head_weight", torch.zeros(0), persistent=False)  # [N, H]
        self.token_counts = None  # [V] int64 NumPy array from the checkpoint's token_counts.npy, if any

    # ------------------------------------------------------------------ wiring
    def bind_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Share the target's token embedding and LM head ([V, H] each, frozen)."""
        V, H = self.config.vocab_size, self.config.hidden_size
        for name, w in (("embedding", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(w.shape) != (V, H):
                raise DFlash2Error(f"target {name} has shape {tuple(w.shape)}, drafter expects (vocab_size={V}, "
                                   f"hidden_size={H})")
        self.embed_weight = embed_weight.detach()
        self.lm_head_weight = lm_head_weight.detach()

    def at_block_size(self, block_size: int) -> DFlash2Drafter:
        """The same weights drafting blocks of ``block_size`` (no weight depends on it): a new eval-mode
        drafter with the token counts and, when bound, the target binding of this one."""
        d = type(self)(self.config.replace(block_size=block_size))
        d.load_state_dict(self.state_dict(), strict=True)
        d.token_counts = self.token_counts
        if self.embed_weight.numel():
            d.bind_target(self.embed_weight, self.lm_head_weight)
        return d.eval()

    def restrict_vocab(self, ids: torch.Tensor) -> None:
        """Let the head propose only the token ids ``ids`` [N] (the LM head keeps their rows: an N/V share of
        its cost); every other id gets the dtype's lowest logit, so it is never drafted. Drafts stay lossless
        (the target verifies every token). Call after bind_target."""
        self._check_bound()
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.lm_head_weight.device)
        V, K = self.config.vocab_size, self.config.selector_top_k
        if ids.ndim != 1 or not K <= ids.numel() <= V or torch.unique(ids).numel() != ids.numel() \
                or not 0 <= int(ids.min()) <= int(ids.max()) < V:
            raise DFlash2Error(f"a draft vocabulary must be {K}..{V} distinct token ids in [0, {V})")
        ids = ids.sort().values  # ascending: the restricted head's order of ids is the full head's (ties alike)
        self.draft_vocab = ids
        self.draft_head_weight = self.lm_head_weight[ids].clone()

    def set_ablation(self, use_conv: bool | None = None, use_selector: bool | None = None) -> None:
        """Turn the convolutions and/or the selector off (DFlash v1 behaviour); cannot turn on absent parts."""
        if use_conv is not None:
            if use_conv and not hasattr(self.layers[0], "attention_conv") and len(self.layers):
                raise DFlash2Error("this drafter has no convolutions (DFlash v1 checkpoint)")
            self.use_conv = use_conv
        if use_selector is not None:
            if use_selector and not hasattr(self, "candidate_selector"):
                raise DFlash2Error("this drafter has no candidate selector (DFlash v1 checkpoint)")
            self.use_selector = use_selector

    @torch.no_grad()
    def reset_identity_convs(self) -> None:
        for layer in self.layers:
            if hasattr(layer, "attention_conv"):
                layer.attention_conv.reset_identity()
                layer.mlp_conv.reset_identity()

    def _check_bound(self) -> None:
        if self.embed_weight.numel() == 0:
            raise DFlash2Error("drafter is not bound to a target: call bind_target(embedding, lm_head)")

    # ------------------------------------------------------------------ context
    def fuse_context(self, feats: torch.Tensor) -> torch.Tensor:
        """feats [..., n, n_layers*H_t] (target layer outputs, concatenated) -> c [..., n, H]."""
        return self.hidden_norm(self.fc(feats))

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """c [S, n, H], positions [S, n] or [n] -> per layer (k, v) [S, kvh, n, d]."""
        cfg = self.config
        assert cfg.head_dim is not None
        cos, sin = rope_tables(positions, cfg, c.dtype)  # [.., n, d]
        return [layer.self_attn.kv(c, cos, sin) for layer in self.layers]

    def extend_context(self, ctx: DraftContext, feats: torch.Tensor, start: int) -> None:
        """Append the features of positions start..start+m-1 (feats [m, n*H_t]) to the cache."""
        if start != ctx.length:
            raise DFlash2Error(f"draft context is at length {ctx.length}, got features for position {start}")
        m = feats.shape[0]
        pos = torch.arange(start, start + m, device=feats.device)
        kv = self.context_kv(self.fuse_context(feats).unsqueeze(0), pos)
        ctx.append(kv)

    # ------------------------------------------------------------------ block pass
    def block_embeddings(self, anchor_ids: torch.Tensor) -> torch.Tensor:
        """anchor_ids [nb] -> [nb, bs, H]: embed([anchor, MASK x L]) (x input_embedding_scale)."""
        self._check_bound()
        cfg = self.config
        nb = anchor_ids.shape[0]
        # broadcasting only (no Expand of traced shapes)
        ids = torch.cat([anchor_ids.view(nb, 1), self.mask_ids + 0 * anchor_ids.view(nb, 1)], dim=1)  # [nb, bs]
        x = self.embed_weight[ids]  # [nb, bs, H]
        if cfg.learned_mask_embedding:
            x = torch.cat([x[:, :1], self.mask_embedding + 0 * x[:, 1:]], dim=1)
        if cfg.input_embedding_scale is not None:
            x = x * cfg.input_embedding_scale
        return x

    def visibility(
        self,
        anchor_pos: torch.Tensor,  # [nb] int64
        C: int,  # context slots; slot j holds position j
        causal: bool,
        window: int | None,
        ctx_valid: torch.Tensor | None = None,  # [nb or 1, C] bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ctx_ok [nb, bs, C], blk_ok [nb, bs, bs]) bool, True = may attend, for one kind of layer.

        Context slots strictly before the anchor (and valid). A window hides keys ``window`` or more positions
        behind the query and, on a non-causal layer, block rows that far ahead too (z-lab's two-sided window;
        context rows are never ahead). Broadcasting only, so the exported block graph traces it as it is."""
        nb, bs = anchor_pos.shape[0], self.config.block_size
        block_pos = anchor_pos.view(nb, 1) + torch.arange(bs, device=anchor_pos.device)  # [nb, bs]
        ctx_pos = torch.arange(C, device=anchor_pos.device).view(1, 1, -1)  # [1, 1, C]
        qp = block_pos.unsqueeze(-1)  # [nb, bs, 1]
        kp = block_pos.unsqueeze(1)  # [nb, 1, bs]
        ctx_ok = (ctx_pos < anchor_pos.view(nb, 1, 1)) & (qp >= 0)  # [nb, bs, C]
        if ctx_valid is not None:
            ctx_ok = ctx_ok & ctx_valid.unsqueeze(1)
        blk_ok = kp <= qp if causal else (kp >= 0) & (qp >= 0)  # [nb, bs, bs]
        if window is not None:
            ctx_ok = ctx_ok & (qp - ctx_pos < window)
            blk_ok = blk_ok & (qp - kp < window)
            if not causal:
                blk_ok = blk_ok & (kp - qp < window)
        return ctx_ok, blk_ok

    def block_forward(
        self,
        anchor_ids: torch.Tensor,  # [nb] int64
        anchor_pos: torch.Tensor,  # [nb] int64 absolute position of the anchor
        ctx_k: list[torch.Tensor],  # per layer [nb or 1, kvh, C, d]; slot j holds position j
        ctx_v: list[torch.Tensor],
        ctx_valid: torch.Tensor | None = None,  # [nb or 1, C] bool (None: every slot holds a position)
        layer_fn: Callable[..., torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One-shot block pass -> normed hidden states h [nb, bs, H].

        Block rows see what :meth:`visibility` allows for their layer. Masks are built with broadcasting
        only, so the exported block graph traces this method as it is. ``layer_fn(layer, *args)`` runs each layer
        in place of ``layer(*args)`` (the ONNX Runtime flavour's export: one node per layer)."""
        cfg = self.config
        assert cfg.head_dim is not None
        nb, bs = anchor_ids.shape[0], cfg.block_size
        h = self.block_embeddings(anchor_ids).to(self.fc.weight.dtype)
        block_pos = anchor_pos.view(nb, 1) + torch.arange(bs, device=anchor_ids.device)  # [nb, bs]
        cos, sin = rope_tables(block_pos, cfg, h.dtype)  # [nb, bs, d]
        C = ctx_k[0].shape[2] if len(ctx_k) else 0
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        biases: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, layer in enumerate(self.layers):
            key = (cfg.layer_is_causal(i), cfg.layer_window(i))
            if key not in biases:
                biases[key] = attention_biases(*self.visibility(anchor_pos, C, *key, ctx_valid), rep, h.dtype)
            args = (h, cos, sin, ctx_k[i], ctx_v[i], *biases[key], self.use_conv)
            h = layer(*args) if layer_fn is None else layer_fn(layer, *args)
        return self.norm(h)

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """The head's raw products -> logits: x output_multiplier, tanh soft-cap."""
        cfg = self.config
        if cfg.output_multiplier is not None:
            x = x * cfg.output_multiplier
        if cfg.final_logit_softcapping is not None:
            c = cfg.final_logit_softcapping
            x = torch.tanh(x / c) * c
        return x

    def top_candidates(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """h [..., H] -> (unary, ids) [..., k]: the ``k`` largest logits of :meth:`logits` (descending, ties: lower
        id first) and their token ids. A restricted head takes them among its own N logits and maps the positions
        to ids (ascending, so the order of ties is the full head's): the same result without a [..., V] tensor."""
        if self.draft_vocab.numel() == 0:
            return torch.topk(self.logits(h).float(), k, dim=-1, sorted=True)
        unary, pos = torch.topk(self._scaled(h @ self.draft_head_weight.t()).float(), k, dim=-1, sorted=True)
        return unary, self.draft_vocab[pos]

    def logits(self, h: torch.Tensor, rows_of_head: torch.Tensor | None = None) -> torch.Tensor:
        """h [..., H] -> logits [..., V] (shared LM head, x output_multiplier, tanh soft-cap).

        ``rows_of_head`` (training's sampled softmax): only those vocabulary ids -> [..., len(rows)]."""
        self._check_bound()
        cfg = self.config
        restricted = rows_of_head is None and self.draft_vocab.numel() > 0
        if restricted:
            w = self.draft_head_weight
        else:
            w = self.lm_head_weight if rows_of_head is None else self.lm_head_weight[rows_of_head]
        x = self._scaled(h @ w.t())
        if restricted:  # back to [..., V]: ids outside the draft vocabulary get the lowest logit
            full = torch.full((*x.shape[:-1], cfg.vocab_size), torch.finfo(x.dtype).min, dtype=x.dtype,
                              device=x.device)
            x = full.scatter(-1, self.draft_vocab.expand(*x.shape[:-1], -1), x)
        return x

    # ------------------------------------------------------------------ drafting
    def draft_from_hidden(
        self,
        h: torch.Tensor,  # [nb, bs, H]
        anchor_ids: torch.Tensor,  # [nb]
        mode: str = "greedy",
        temperature: float = 0.0,
        uniforms: torch.Tensor | None = None,  # [nb, L] in [0, 1)
        verified_rows: int | None = None,
    ) -> Draft:
        """Head + selector: rows 1..bs-1 -> drafts. ``mode`` 'independent' (or a drafter without the selector):
        each row's own argmax / sample.

        ``verified_rows`` n < L (a final partial block): the rows past n get zero hidden states, so their
        logits, the selector's projection and hence their lattice scores are exactly 0 — the path (Viterbi's
        argmax, its sampled chain) of the first n rows is then the one over those n rows alone
        (:func:`dflash2_trt.reference.walk_one` on ``S[:n]``). Drafts past n are meaningless."""
        if verified_rows is not None and verified_rows < h.shape[1] - 1:
            h = h.clone()
            h[:, 1 + verified_rows:] = 0
        rows = h[:, 1:]  # [nb, L, H]
        nb, L, H = rows.shape
        # a 2-D GEMM: the strided 3-D view runs as a batched matmul that re-streams the head per block (≈ 9x
        # slower on a CPU: benchmarks/train_step_cost.py)
        logits = self.logits(rows.reshape(nb * L, H)).float().view(nb, L, -1)  # [nb, L, V]
        V = logits.shape[-1]
        if mode == INDEPENDENT or not self.use_selector:
            if temperature > 0:
                if uniforms is None:
                    raise ValueError("temperature > 0 needs uniforms [nb, L]")
                q = torch.softmax(logits / temperature, dim=-1)  # [nb, L, V]
                tok = (q.cumsum(-1) <= uniforms.unsqueeze(-1)).sum(-1).clamp(max=V - 1)
            else:
                tok = logits.argmax(-1)  # [nb, L]
                q = nn.functional.one_hot(tok, V).float()
            # cand: each row's top-K (argmax first) — only the oracle top-K τ reads it
            top = torch.topk(logits, min(self.config.selector_top_k, V), dim=-1, sorted=True).indices
            if temperature <= 0:
                top[..., 0] = tok
            return Draft(tokens=tok, proposal=q, cand=top, logits=logits)
        K = self.config.selector_top_k
        unary, cand = torch.topk(logits, K, dim=-1, sorted=True)  # [nb, L, K]
        cs = self.candidate_selector
        g = cs.hidden_projection(rows).float()  # [nb, L, r]
        ids, _, qk = sel.select_paths(cand, unary, g, anchor_ids, cs.predecessor_codebook, cs.successor_codebook,
                                      mode=mode, temperature=temperature, uniforms=uniforms,
                                      precision=self.selector_precision)
        q = torch.zeros(nb, L, V, dtype=torch.float32, device=logits.device).scatter_(-1, cand, qk)
        return Draft(tokens=ids, proposal=q, cand=cand, logits=logits)
