"""The dense mixture-of-experts family: Qwen3-MoE (transformers ``qwen3_moe``). Full attention in every layer (a
KV cache, cropped after a rejected draft, as the dense family's) and routed experts in the MLPs: top-k routing per
token, exactly transformers' own. Export: the dense family's graph with :func:`routed_mlp` in the MLPs that have
experts (the Qwen3.5 MoE targets of the hybrid family use it too).
"""

from __future__ import annotations

from typing import Any

import torch

from dflash2_trt.errors import DFlash2Error
from dflash2_trt.targets import dense
from dflash2_trt.targets.dense import before_forward, graph_io, layer_kinds, new_cache, rollback

MODEL_TYPES = ("qwen3_moe",)

__all__ = ["MODEL_TYPES", "TargetGraph", "before_forward", "check_exportable", "graph_io", "layer_kinds",
           "new_cache", "rollback", "routed_mlp"]


def check_exportable(hf_model: Any) -> None:
    """The exporter's graph computes this target exactly, else DFlash2Error saying what it does not."""
    cfg = hf_model.config
    if cfg.model_type not in MODEL_TYPES:
        raise DFlash2Error(f"target model_type {cfg.model_type!r} is not a {', '.join(MODEL_TYPES)} target")
    dense.check_attention_config(cfg)


def routed_mlp(block: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers' sparse MoE block with its top-k routing as graph ops: the router's softmax, its top k
    (renormalised where the router does), each token's chosen experts' weights gathered (no loop over experts,
    no data-dependent shapes), plus the sigmoid-gated shared expert where the block has one."""
    B, S, H = x.shape
    t = x.reshape(-1, H)
    router = block.gate
    probs = torch.softmax(torch.nn.functional.linear(t, router.weight).float(), dim=-1)
    top, idx = torch.topk(probs, router.top_k, dim=-1)  # [T, k]
    if getattr(router, "norm_topk_prob", True):
        top = top / top.sum(dim=-1, keepdim=True)
    top = top.to(x.dtype)
    ex = block.experts
    gu = torch.matmul(ex.gate_up_proj[idx], t[:, None, :, None])[..., 0]  # [T, k, 2I]
    inter = gu.shape[-1] // 2
    hidden = ex.act_fn(gu[..., :inter]) * gu[..., inter:]
    out = (torch.matmul(ex.down_proj[idx], hidden[..., None])[..., 0] * top[..., None]).sum(dim=1)  # [T, H]
    if hasattr(block, "shared_expert"):
        out = out + torch.sigmoid(block.shared_expert_gate(t)) * block.shared_expert(t)
    return out.reshape(B, S, H)


class TargetGraph(dense.TargetGraph):
    """The dense family's graph (:class:`dflash2_trt.targets.dense.TargetGraph`: same inputs and outputs) with routed
    experts in the MLPs that have them."""

    @staticmethod
    def _check(hf_model: Any) -> None:
        check_exportable(hf_model)

    def _mlp(self, m, x):  # noqa: ANN001, ANN202
        return routed_mlp(m, x) if hasattr(m, "experts") else super()._mlp(m, x)
