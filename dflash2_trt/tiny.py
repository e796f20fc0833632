"""``make-tiny``: a small random-weight Llama-style target (with a locally built tokenizer) and a matching
random DFlash 2 drafter, for smoke tests of any pipeline. Nothing is downloaded.

``--accepting``: instead, a pair whose drafts are accepted often, so the commit / crop / context paths run on
most cycles. Both models are set by hand (no training, deterministic, well under a second):

* the target copies: the token after position n is the token at n + 1 - P (P = ``COPY_PERIOD``), done by one
  attention head pair in layer 0 whose RoPE scores peak at distance P - 1 (queries and keys read a constant
  part of every embedding; values carry the token's code; the LM head reads the copied code). A small random
  MLP in layer 1 makes it deviate from the copy now and then (~15% of tokens), so acceptance stops mid-block;
  the deviations are copied in turn, so decoding really depends on the KV cache. The other architectures
  (``--arch``) copy the same way within their own layers: the hybrid ones' departures come from their linear
  layers (and MoE experts), Qwen3-MoE's from its experts; gpt-oss and Muse Glimmer, whose sliding windows (8) are
  shorter than the copy distance, copy in a full-attention layer (gpt-oss layer 1, Muse Glimmer layer 3) and
  depart through random sliding attention (so the next token depends on the window's keys) and their MLPs; Gemma
  4 copies in its first full layer and departs through a sliding layer that attends over the keys it shares with
  layer 0, and an MLP; Nemotron-H, whose attention has no position embeddings, copies through layer 0's Mamba-2
  convolution (P taps) and departs through its experts, its attention and a random Mamba-2 layer;
* the drafter's layer 0 does the same from the context features (RoPE peak at distance P): draft row k
  copies the context token at anchor + k - P, which is what the target will say unless it deviates. Its
  selector has small random weights (it can reorder near-equal candidates, and does so rarely).

Layout written::

    OUT/target/   config.json, model.safetensors, tokenizer.json, tokenizer_config.json, ...
    OUT/drafter/  config.json, model.safetensors
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from dflash2_trt.config import DFlash2Config
from dflash2_trt.vocabulary import TINY_ARCHS

TINY_VOCAB = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    """Deterministic local training text for the tokenizer: docstrings of a few stdlib modules."""
    import collections
    import functools
    import itertools
    import json as _json
    import textwrap

    texts = []
    for mod in (collections, functools, itertools, _json, textwrap, inspect, os.path):
        for _, obj in sorted(vars(mod).items()):
            doc = inspect.getdoc(obj) if callable(obj) else None
            if doc:
                texts.append(doc)
    texts.append("Hello world! The quick brown fox jumps over the lazy dog. 0123456789")
    return texts


def build_tokenizer(vocab_size: int = TINY_VOCAB):
    """A byte-level BPE tokenizer trained on local text; ids 0..3 are the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   mask_token="<|mask|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny(out: str | os.PathLike, seed: int = 0, block_size: int = 16, accepting: bool = False,
              arch: str = "llama") -> tuple[Path, Path]:
    """Write OUT/target and OUT/drafter (atomically: built in a temp folder, moved into place).
    ``accepting``: the copying pair of the module docstring (block_size <= COPY_PERIOD); ``arch``: the target's
    architecture (:data:`TINY_ARCHS`)."""
    from dflash2_trt.errors import DFlash2Error
    from dflash2_trt.model import DFlash2Drafter, save_drafter

    if accepting and not 2 <= block_size <= COPY_PERIOD:
        raise DFlash2Error(f"--accepting needs --block-size in [2, {COPY_PERIOD}], got {block_size}")
    if arch not in TINY_ARCHS:
        raise DFlash2Error(f"--arch must be one of {', '.join(TINY_ARCHS)}, got {arch!r}")
    out = Path(out)
    _check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    # written first: a folder make-tiny was interrupted in is still recognisably its own
    (out / README).write_text(json.dumps({"made_by": MADE_BY, "seed": seed, "accepting": accepting, "arch": arch})
                              + "\n")
    torch.manual_seed(seed)
    tok = build_tokenizer()
    vocab = len(tok)
    target = _target_model(arch, vocab, accepting).eval()
    if accepting:
        target.load_state_dict(_COPYING[arch](target.state_dict(), seed))
    tmp = Path(tempfile.mkdtemp(prefix=".target.", dir=out))
    target.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    dst = out / "target"
    if dst.exists():
        shutil.rmtree(dst)
    tmp.rename(dst)

    dcfg = DFlash2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=vocab, num_target_layers=4,
                         target_layer_ids=[0, 2], block_size=block_size, mask_token_id=1, selector_rank=24,
                         selector_top_k=16, rms_norm_eps=1e-6, rope_theta=10000.0)
    drafter = DFlash2Drafter(dcfg)
    if accepting:
        drafter.load_state_dict(_copying_drafter_weights(drafter.state_dict(), seed))
    else:
        with torch.no_grad():
            for name, p in drafter.named_parameters():
                if name.endswith("norm.weight"):
                    continue
                if "base_kernel" in name:  # identity plus a random perturbation, so the convolutions matter
                    p.add_(torch.randn_like(p) * 0.1)
                elif "kernel_projection" in name:
                    p.normal_(0.0, 0.02)
                else:
                    p.normal_(0.0, 0.2)
    save_drafter(drafter, out / "drafter")
    return out / "target", out / "drafter"


README, MADE_BY = "README.txt", "dflash2 make-tiny"
# the hybrid targets' layers: layer 0 must be full attention (the copy head of --accepting)
HYBRID_LAYER_TYPES = ["full_attention", "linear_attention", "linear_attention", "full_attention"]


def _target_model(arch: str, vocab: int, accepting: bool = False) -> torch.nn.Module:
    """A random tiny target of ``arch``: 4 layers, hidden 64, 4 heads of 16 (2 KV heads); the hybrid ones with
    linear layers 1 and 2 (4 value / 2 key heads of 16, a 4-tap convolution) and full RoPE (the copy head's peak
    needs every frequency), the MoE one with 4 experts (2 per token) and a shared expert in every MLP.
    ``accepting``: the config the copying target needs where it differs (Muse Glimmer's, :func:`_family_model`)."""
    common = dict(vocab_size=vocab, hidden_size=_H, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None,
                  eos_token_id=0, pad_token_id=0, initializer_range=0.2)
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(intermediate_size=128, **common))
    if arch in ("qwen3_moe", "gpt_oss", "muse_glimmer"):
        return _family_model(arch, common, accepting)
    if arch == "gemma4":
        return _gemma4_model(vocab)
    if arch == "nemotron_h":
        return _nemotron_h_model(vocab, accepting)
    hybrid = dict(head_dim=_HD, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=_HD,
                  linear_value_head_dim=_HD, linear_conv_kernel_dim=4, layer_types=list(HYBRID_LAYER_TYPES),
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0})
    if arch == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(intermediate_size=128, **common, **hybrid))
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                                      shared_expert_intermediate_size=32, **common, **hybrid))


def _family_model(arch: str, common: dict, accepting: bool = False) -> torch.nn.Module:
    """The other families' tiny targets (hidden 64, 4 layers): Qwen3-MoE with 4 experts (2 per token); gpt-oss
    (sliding and full layers alternating, 4 experts) and Muse Glimmer (three sliding layers per full one, a
    vision-language model whose text path is the target), both with windows of 8 positions. ``accepting``: Muse
    Glimmer's full layer (layer 3, the copy head) gets RoPE (NoPE otherwise, as the released model's full layers),
    its q scale is the copy head's sharpness and its output multiplier keeps the logits well inside the soft cap."""
    import transformers

    common = {**common, "head_dim": _HD, "intermediate_size": 128}
    if arch == "qwen3_moe":
        return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **common))
    if arch == "gpt_oss":
        return transformers.GptOssForCausalLM(transformers.GptOssConfig(
            num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"] * 2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common))
    text = {k: v for k, v in common.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    if accepting:
        text.update(layer_rope_theta=[10000.0] * 4, qk_scale_factor=_TARGET_SHARPNESS / 4,
                    output_multiplier=_MUSE_OUTPUT_MULTIPLIER)
    return transformers.MuseGlimmerForConditionalGeneration(transformers.MuseGlimmerConfig(
        text_config=dict(sliding_window=8, bos_token_id=1, eos_token_id=0, pad_token_id=0, **text),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)))


# Nemotron-H: Mamba-2 (the copy of --accepting), MoE, attention, Mamba-2
NEMOTRON_H_LAYER_TYPES = ["linear_attention", "moe", "full_attention", "linear_attention"]


def _nemotron_h_model(vocab: int, accepting: bool = False) -> torch.nn.Module:
    """A random tiny Nemotron-H (hidden 64, :data:`NEMOTRON_H_LAYER_TYPES`): Mamba-2 layers of 8 heads of 8 with a
    state of 8 in 2 groups (a 4-tap convolution; ``accepting``: P taps, the copy's reach), 4 ReLU² experts (2 per
    token) and a shared expert, attention of 4 heads of 16 (2 KV heads) without position embeddings."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    return NemotronHForCausalLM(NemotronHConfig(
        vocab_size=vocab, hidden_size=_H, layers_block_type=list(NEMOTRON_H_LAYER_TYPES), num_attention_heads=4,
        num_key_value_heads=2, head_dim=_HD, intermediate_size=128, mamba_num_heads=8, mamba_head_dim=8,
        ssm_state_size=8, n_groups=2, conv_kernel=COPY_PERIOD if accepting else 4, chunk_size=16, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
        max_position_embeddings=2048, layer_norm_epsilon=1e-6, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=0, pad_token_id=0))


def _check_out(out: Path) -> None:
    """OUT is absent, empty, or a folder make-tiny wrote (its README.txt says so, and it holds only what
    make-tiny writes): OUT/target is replaced, so it must never be someone else's."""
    from dflash2_trt.errors import DFlash2Error
    from dflash2_trt.outdir import check_entries

    if not out.is_dir() or not any(out.iterdir()):
        return check_entries(out, "--out", lambda n: False, "make-tiny output")
    try:
        ours = json.loads((out / README).read_text()).get("made_by") == MADE_BY
    except (OSError, ValueError, AttributeError):
        ours = False
    if not ours:
        raise DFlash2Error(f"--out {out} is a non-empty folder that make-tiny did not write (no {README} of "
                           f"make-tiny); refusing to write into it: choose another --out")
    check_entries(out, "--out", lambda n: n in (README, "target", "drafter") or n.startswith(".target."),
                  "make-tiny output")


# ----------------------------------------------------------------------------------------------------
# The accepting pair (--accepting): a copying target and a drafter that copies the same way
# ----------------------------------------------------------------------------------------------------

COPY_PERIOD = 16  # P: the target repeats the token P positions back; draft rows 1..P-1 read only context
_H, _HD = 64, 16  # hidden size, head dim of both models (make_tiny's shapes)
_CONST, _CODE, _COPY, _MARK = slice(0, 8), slice(8, 32), slice(32, 56), slice(56, 64)  # hidden-dim roles
_TARGET_SHARPNESS, _DRAFTER_SHARPNESS = 80.0, 20.0  # attention logit scales: peak vs next-best distance > 7
_COPY_GAIN, _HEAD_GAIN = 4.0, 3.0  # copied code vs own code in the residual; LM head logit scale
_TIE_BREAK = 0.3  # LM head weights on the own-token code: logit offsets of std ~2 (the copy's margin is ~19)
_DEVIATION = 0.01  # scale of layer 1's random MLP: the target departs from the copy on ~15% of tokens
_LINEAR_DEVIATION = 0.15  # scale of the hybrid target's linear layers' output: its departures from the copy
_MOE_DEVIATION = 0.0105  # scale of the Qwen3-MoE target's experts' down projections: departures on ~7% of tokens
# gpt-oss: its experts' down projections and layer 2's sliding attention output (together ~13%)
_GPT_OSS_EXPERT_DEVIATION, _SLIDING_DEVIATION = 0.06, 0.25
# Muse Glimmer: the scales of layers 1-2's post-attention norms and layer 3's post-MLP norm (together ~10%; the copied
# code's entries are ~5.7 and the nearest other codes differ from it in a few places, so a departure needs a push of
# about that size)
_SLIDING_DEVIATION_MUSE, _MLP_DEVIATION_MUSE = 0.35, 5.0
_NO_SINK = -100.0  # gpt-oss's attention sink logits: no mass
_MUSE_OUTPUT_MULTIPLIER = 1 / 16  # the copied token's logit (~113 at the LM head) -> ~7, well inside the cap of 20
# Nemotron-H: the copy's convolution input and bias scale, its output projection gain (a copied code of ~+-4 as the
# dense target's); the scales of layer 1's expert down projections, layer 2's attention output and layer 3's Mamba-2
# output: the departures from the copy
_MAMBA_CODE, _MAMBA_COPY_GAIN = 4.0, 5.0
_NEMOTRON_MOE_DEVIATION, _NEMOTRON_ATTENTION_DEVIATION, _NEMOTRON_MAMBA_DEVIATION = 0.004, 0.15, 0.45


def _rope_peak(distance: int, theta: float = 10000.0, freqs: tuple[int, ...] = (0, 1, 2, 3)
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [_HD] (rotate_half layout) with RoPE(q, n) . RoPE(k, n - d) = sum_j cos(theta_j (d - distance)):
    largest at d == distance (the four fastest frequencies do not realign within the 2048 positions)."""
    q, k = torch.zeros(_HD, dtype=torch.float64), torch.zeros(_HD, dtype=torch.float64)
    half = _HD // 2
    for j in freqs:
        th = theta ** (-2 * j / _HD)
        q[j] = 1.0
        k[j], k[j + half] = math.cos(th * distance), math.sin(th * distance)
    return q.float(), k.float()


def _token_codes(vocab: int, seed: int) -> torch.Tensor:
    """[V, 24] random +-1 codes, any two differing in >= 2 places (so the copied code's argmax is unique)."""
    g = torch.Generator().manual_seed(seed)
    while True:
        codes = torch.randint(0, 2, (vocab, 24), generator=g).double() * 2 - 1  # [V, 24]
        dist = (24 - codes @ codes.T) / 2
        dist.fill_diagonal_(99)
        if dist.min() >= 2:
            return codes.float()


def _copy_heads(prefix: str, q: torch.Tensor, k: torch.Tensor, q_src: int, k_src: int, v_scale: float
                ) -> dict[str, torch.Tensor]:
    """Attention weights of heads 0 and 2 (kv heads 0 and 1): constant query/key from dims q_src / k_src,
    values = the 24 code dims (12 per kv head), written by o_proj into the copy dims."""
    qw, kw = torch.zeros(4 * _HD, _H), torch.zeros(2 * _HD, _H)
    vw, ow = torch.zeros(2 * _HD, _H), torch.zeros(_H, 4 * _HD)
    for qh, kh in ((0, 0), (2, 1)):
        qw[qh * _HD:(qh + 1) * _HD, q_src] = q
        kw[kh * _HD:(kh + 1) * _HD, k_src] = k
        for i in range(12):
            vw[kh * _HD + i, _CODE.start + 12 * kh + i] = v_scale
            ow[_COPY.start + 12 * kh + i, qh * _HD + i] = _COPY_GAIN
    return {prefix + "q_proj.weight": qw, prefix + "k_proj.weight": kw, prefix + "v_proj.weight": vw,
            prefix + "o_proj.weight": ow}


def _code_embedding_and_head(out: dict[str, torch.Tensor], seed: int, model: str = "model.") -> None:
    """The copying target's embedding (a constant part and the token's code) and LM head (reads the copied code),
    written into ``out`` (``model``: the prefix of the decoder's weights)."""
    emb = out[model + "embed_tokens.weight"]  # [V, H]
    V = emb.shape[0]
    codes = _token_codes(V, seed)  # [V, 24]
    emb[:, _CONST] = 1.0
    emb[:, _CODE] = codes
    out["lm_head.weight"][:, _COPY] = _HEAD_GAIN * codes
    # codes give integer dot products, so thousands of exact logit ties; a small random read of the own-token
    # code spreads them (top-K candidates then do not depend on rounding) without moving the copy's argmax
    g = torch.Generator().manual_seed(seed + 3)
    out["lm_head.weight"][:, _CODE] = torch.randn(V, 24, generator=g) * _TIE_BREAK


def _copying_target_weights(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    out = {k: torch.ones_like(v) if k.endswith("norm.weight") else torch.zeros_like(v) for k, v in sd.items()}
    _code_embedding_and_head(out, seed)
    r = math.sqrt((8 + 24) / _H)  # rms of every embedding row: input_layernorm divides by it
    q, k = _rope_peak(COPY_PERIOD - 1)  # position n attends n + 1 - P
    out.update(_copy_heads("model.layers.0.self_attn.", q * _TARGET_SHARPNESS * r, k * r, 0, 0, r))
    g = torch.Generator().manual_seed(seed + 1)
    m = "model.layers.1.mlp."
    out[m + "gate_proj.weight"] = torch.randn(out[m + "gate_proj.weight"].shape, generator=g)
    out[m + "up_proj.weight"] = torch.randn(out[m + "up_proj.weight"].shape, generator=g)
    out[m + "down_proj.weight"] = torch.randn(out[m + "down_proj.weight"].shape, generator=g) * _DEVIATION
    return out


def _copying_hybrid_weights(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The copying target of the module docstring in a hybrid model: layer 0's gated full attention is the copy
    head (its q / k RMS norms make q and k of fixed size, so the sharpness is the q norm's scale; the output gate
    reads zero weights: sigmoid(0) = 1/2, so the values are doubled); the deviations come from the two linear
    layers (random weights, a small output projection), so the next token depends on their convolution and
    recurrent states and a wrong rollback changes the output; MoE layers' experts are small and random too (the
    routing picks them per token). Norm weights of (1 + w) norms are 0 (scale 1)."""
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    g = torch.Generator().manual_seed(seed + 1)
    for k, v in sd.items():
        if ".linear_attn." in k and not k.endswith("out_proj.weight"):
            out[k] = v.clone() if k.endswith(("A_log", "dt_bias", "norm.weight")) else \
                torch.randn(v.shape, generator=g) * (1.0 if "conv1d" in k else 0.5)
        elif ".linear_attn.out_proj" in k:
            out[k] = torch.randn(v.shape, generator=g) * _LINEAR_DEVIATION
        elif (".mlp.experts." in k or ".mlp.gate.weight" in k) and not k.startswith("model.layers.0."):
            out[k] = torch.randn(v.shape, generator=g) * (_DEVIATION / 4 if "down_proj" in k else 1.0)
    _code_embedding_and_head(out, seed)
    r = math.sqrt((8 + 24) / _H)
    q, k = _rope_peak(COPY_PERIOD - 1)
    a = "model.layers.0.self_attn."
    heads = _copy_heads(a, q, k * r, 0, 0, 2 * r)  # q's scale is the q norm's (below), k's the k norm's
    qw = heads.pop(a + "q_proj.weight")  # [4 * 16, H] -> per head [q (16) | gate (16)]
    out[a + "q_proj.weight"] = torch.stack([qw.view(4, _HD, _H), torch.zeros(4, _HD, _H)], 1).reshape(8 * _HD, _H)
    out.update(heads)
    # q and k normed to rms 1 per head: 2q, 2k; (1 + w_q) = the sharpness / 4 gives the dense target's scores
    out[a + "q_norm.weight"] = torch.full((_HD,), _TARGET_SHARPNESS / 4 - 1.0)
    return out


def _copying_qwen3_moe_weights(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The copying target of the module docstring in Qwen3-MoE: the dense target's copy head in layer 0 behind its
    q / k RMS norms (weight w, not 1 + w: q and k normed to rms 1 per head are 2q, 2k, so q's norm weight = the
    sharpness / 4 gives the dense target's scores, k's is 1); the deviations come from small random experts (and
    random routing) in layers 1-3."""
    out = {k: torch.ones_like(v) if k.endswith("norm.weight") else torch.zeros_like(v) for k, v in sd.items()}
    _code_embedding_and_head(out, seed)
    r = math.sqrt((8 + 24) / _H)
    q, k = _rope_peak(COPY_PERIOD - 1)
    a = "model.layers.0.self_attn."
    out.update(_copy_heads(a, q, k, 0, 0, r))
    out[a + "q_norm.weight"] = torch.full((_HD,), _TARGET_SHARPNESS / 4)
    g = torch.Generator().manual_seed(seed + 1)
    for key, v in sd.items():
        if (".mlp.experts." in key or ".mlp.gate.weight" in key) and not key.startswith("model.layers.0."):
            out[key] = torch.randn(v.shape, generator=g) * (_MOE_DEVIATION if "down_proj" in key else 1.0)
    return out


def _copying_gpt_oss_weights(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The copying target of the module docstring in gpt-oss: the copy distance (P - 1) is beyond the sliding
    window, so the dense target's copy head is in layer 1 (full attention); layer 0 (sliding) passes the embedding
    through unchanged, so target layer 0's output -- the drafter's context -- is the constant part and the code. The
    deviations come from layer 2's sliding attention (random, a small output projection: the next token depends on
    the keys in its window) and small random clamped-SwiGLU experts (random routing) in layers 1-3. Every bias is
    zero; every head's sink logit is very negative (it takes no attention mass)."""
    out = {k: torch.ones_like(v) if k.endswith("norm.weight") else torch.zeros_like(v) for k, v in sd.items()}
    for key in out:
        if key.endswith("self_attn.sinks"):
            out[key].fill_(_NO_SINK)
    _code_embedding_and_head(out, seed)
    r = math.sqrt((8 + 24) / _H)
    q, k = _rope_peak(COPY_PERIOD - 1)
    out.update(_copy_heads("model.layers.1.self_attn.", q * _TARGET_SHARPNESS * r, k * r, 0, 0, r))
    g = torch.Generator().manual_seed(seed + 1)
    a = "model.layers.2.self_attn."
    for proj in ("q_proj", "k_proj", "v_proj"):
        out[a + proj + ".weight"] = torch.randn(sd[a + proj + ".weight"].shape, generator=g) * 0.25
    out[a + "o_proj.weight"] = torch.randn(sd[a + "o_proj.weight"].shape, generator=g) * _SLIDING_DEVIATION
    for key, v in sd.items():
        if key.startswith("model.layers.0.") or key.endswith("bias"):
            continue
        if key.endswith(("mlp.router.weight", "experts.gate_up_proj")):
            out[key] = torch.randn(v.shape, generator=g) * 0.25
        elif key.endswith("experts.down_proj"):
            out[key] = torch.randn(v.shape, generator=g) * _GPT_OSS_EXPERT_DEVIATION
    return out


def _copying_muse_glimmer_weights(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The copying target of the module docstring in Muse Glimmer's text path. Its full layer (layer 3: RoPE in the
    accepting config) holds the copy head: q and k are RMS-normed without scale (2q, 2k per head) and q is multiplied
    by ``qk_scale_factor`` (the config's: the sharpness / 4, the dense target's scores); the output gate reads zero
    weights (sigmoid(0) = 1/2) and the attention output is RMS-normed before the residual, so the copied code's size
    is that norm's scale (1 + w), set to give the dense target's copy / own-code ratio over the normed embedding
    (every entry +-sqrt(2)). Layer 0 is inert (its norms see zeros and give zeros), so target layer 0's output -- the
    drafter's context -- is the normed embedding: constant part and code. The deviations come from layers 1-2's
    sliding attention (random, after a post-attention norm of small scale: the next token depends on their windows)
    and layer 3's random MLP (its post-MLP norm's scale sets how hard it pushes). The logits stay well inside the soft
    cap (the accepting config's output multiplier). The vision tower keeps its random weights."""
    m = "model.language_model."
    out = {}
    for key, v in sd.items():
        if not key.startswith(m) and key != "lm_head.weight":
            out[key] = v.clone()
        else:  # the decoder layers' ("centred") RMS norms scale by 1 + w (0: 1), the final norm by w
            out[key] = torch.ones_like(v) if key == m + "norm.weight" else torch.zeros_like(v)
    _code_embedding_and_head(out, seed, m)
    q, k = _rope_peak(COPY_PERIOD - 1)
    a = m + "layers.3."
    out.update(_copy_heads(a + "self_attn.", q, k, 0, 0, 1.0))
    r = math.sqrt((8 + 24) / _H)  # embedding entries +-1 -> +-1 / r; copied code entries (24 of 64) -> +-sqrt(64 / 24)
    out[a + "post_attention_layernorm.weight"] = torch.full((_H,), _COPY_GAIN / r / math.sqrt(_H / 24) - 1.0)
    g = torch.Generator().manual_seed(seed + 1)
    for layer in (1, 2):
        a = f"{m}layers.{layer}."
        for proj in ("q_proj", "k_proj", "v_proj", "gate_proj", "o_proj"):
            out[a + "self_attn." + proj + ".weight"] = torch.randn(sd[a + "self_attn." + proj + ".weight"].shape,
                                                                   generator=g) * 0.25
        out[a + "post_attention_layernorm.weight"] = torch.full((_H,), _SLIDING_DEVIATION_MUSE - 1.0)
    a = m + "layers.3."
    for proj in ("gate_proj", "up_proj", "down_proj"):
        out[a + "mlp." + proj + ".weight"] = torch.randn(sd[a + "mlp." + proj + ".weight"].shape, generator=g)
    out[a + "post_feedforward_layernorm.weight"] = torch.full((_H,), _MLP_DEVIATION_MUSE - 1.0)
    return out


def _copying_nemotron_h_weights(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The copying target of the module docstring in Nemotron-H, whose attention has no position embeddings: the copy
    is layer 0's Mamba-2 convolution (P taps, only the oldest one set: position n reads the input of n + 1 - P). Its
    channels 0-23 take the token's code (times _MAMBA_CODE), channel 24 nothing; every one gets the bias
    _MAMBA_CODE, so after the convolution's SiLU a code entry of +1 is silu(2 _MAMBA_CODE), -1 is silu(0), and
    channel 24 (and every channel before P positions exist) silu(_MAMBA_CODE), about halfway: the output projection
    writes (code channel - channel 24) into the copy dims, a code of nearly symmetric +-4 after the gated group norm
    (a constant gate). The scan reads no B / C (zero) so layer 0's output is that skip path (D = 1) alone. The
    deviations come from layer 1's small random experts (random routing), layer 2's random attention (the next token
    depends on its KV) and layer 3's random Mamba-2 layer (its convolution and scan states). Norm weights are 1."""
    out = {k: torch.ones_like(v) if k.endswith(("norm.weight", "norm_f.weight", "mixer.D")) else torch.zeros_like(v)
           for k, v in sd.items()}
    out["model.embed_tokens.weight"] = out.pop("model.embeddings.weight")
    _code_embedding_and_head(out, seed)
    out["model.embeddings.weight"] = out.pop("model.embed_tokens.weight")
    r = math.sqrt((8 + 24) / _H)  # rms of every embedding row: the block's norm divides by it
    m = "model.layers.0.mixer."
    inter = sd[m + "out_proj.weight"].shape[1]  # [H, heads * head_dim]
    w = out[m + "in_proj.weight"]  # [gate (inter) | x, B, C (conv_dim) | dt (heads), H]
    w[:inter, _CONST] = 0.25  # a constant gate (its scale cancels in the group norm)
    for j in range(24):
        w[inter + j, _CODE.start + j] = _MAMBA_CODE * r
    out[m + "conv1d.weight"][:25, 0, 0] = 1.0  # the oldest tap: position n reads n - (P - 1)
    out[m + "conv1d.bias"][:25] = _MAMBA_CODE
    out[m + "out_proj.weight"][_COPY, :24] = _MAMBA_COPY_GAIN * torch.eye(24)
    out[m + "out_proj.weight"][_COPY, 24] = -_MAMBA_COPY_GAIN
    for key in ("A_log", "dt_bias"):
        out[m + key] = sd[m + key].clone()
    g = torch.Generator().manual_seed(seed + 1)
    for key, v in sd.items():
        if key.startswith("model.layers.1.mixer.") and not key.endswith("e_score_correction_bias"):
            out[key] = torch.randn(v.shape, generator=g) * (_NEMOTRON_MOE_DEVIATION if "down_proj" in key else 1.0)
        elif key.startswith("model.layers.2.mixer."):
            out[key] = torch.randn(v.shape, generator=g) * (_NEMOTRON_ATTENTION_DEVIATION if "o_proj" in key else 0.25)
        elif key.startswith("model.layers.3.mixer.") and not key.endswith(("norm.weight", "mixer.D")):
            out[key] = sd[key].clone() if key.endswith(("A_log", "dt_bias")) else \
                torch.randn(v.shape, generator=g) * (_NEMOTRON_MAMBA_DEVIATION if "out_proj" in key else 0.5)
    return out


def _copying_drafter_weights(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    out = {k: torch.zeros_like(v) for k, v in sd.items()}
    for k in out:
        if k.endswith("norm.weight"):  # q_norm / k_norm set the attention sharpness
            out[k] += math.sqrt(_DRAFTER_SHARPNESS) if ".self_attn." in k else 1.0
        if "base_kernel" in k:  # identity convolutions
            out[k][:, 0, :] = 1.0
    fc = out["fc.weight"]  # [H, 2H]: context = target layer 0's output (constant part -> marker, code -> code)
    fc[_MARK, _CONST] = torch.eye(8)
    fc[_CODE, _CODE] = torch.eye(24)
    q, k = _rope_peak(COPY_PERIOD)  # row at s + k attends context position s + k - P
    out.update(_copy_heads("layers.0.self_attn.", q, k, _CONST.start, _MARK.start, 1.0))
    g = torch.Generator().manual_seed(seed + 2)
    cs = "candidate_selector."
    out[cs + "hidden_projection.weight"] = torch.randn(out[cs + "hidden_projection.weight"].shape, generator=g) * 0.05
    out[cs + "predecessor_codebook"] = torch.randn(out[cs + "predecessor_codebook"].shape, generator=g) * 0.5
    out[cs + "successor_codebook"] = torch.randn(out[cs + "successor_codebook"].shape, generator=g) * 0.5
    return out


# Gemma 4: sliding / full layers alternating; the last two layers share the keys and values of the first two
GEMMA4_LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
_GEMMA_GLOBAL_HD = 32  # the full layers' head size (the sliding layers': _HD), one KV head whose keys are its values
_GEMMA_CAP = 10.0  # final logit soft cap
_GEMMA_HEAD_SCALE = 1 / 16  # the copied token's logit (~113 at make-tiny's LM head) -> ~7, inside the cap
# the scales of layer 2's (shared) sliding attention output and layer 3's MLP output (after their post-norms)
_GEMMA_SLIDING_DEVIATION, _GEMMA_MLP_DEVIATION = 35.0, 15.0


def _gemma4_model(vocab: int) -> torch.nn.Module:
    """A random tiny Gemma 4 (the multimodal model, as released: its text model is the target): hidden 64,
    :data:`GEMMA4_LAYER_TYPES` with windows of 8; sliding layers of 4 heads of 16 (2 KV heads, RoPE θ 10⁴), full
    layers of 4 heads of 32 over one KV head whose keys are also its values (proportional RoPE on a quarter of the
    head, θ 10⁸: the same four frequencies as the sliding layers' fastest); layers 2 and 3 share layers 0 and 1's keys
    and values; logits soft-capped at 10; no per-layer-input embeddings."""
    import transformers

    text = dict(vocab_size=vocab, hidden_size=_H, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=_HD, global_head_dim=_GEMMA_GLOBAL_HD, num_global_key_value_heads=1,
                attention_k_eq_v=True, num_kv_shared_layers=2, layer_types=list(GEMMA4_LAYER_TYPES), sliding_window=8,
                final_logit_softcapping=_GEMMA_CAP, hidden_size_per_layer_input=0, max_position_embeddings=2048,
                rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=2, eos_token_id=0, pad_token_id=0,
                initializer_range=0.2,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 1e8}})
    return transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(
        text_config=text, audio_config=None, tie_word_embeddings=False,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=16)))


def _copying_gemma4_weights(sd: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """The copying target of the module docstring in Gemma 4's text model. The embedding is scaled by sqrt(H) = 8 and
    every layer's attention and MLP outputs are RMS-normed before the residual (norms of weight w, ones: 1). Layer 1
    (full) holds the copy head: its one KV head's projection carries the RoPE peak (the four rotated frequency pairs)
    and the token's code (the 24 unrotated dims): the keys are also the values, so the peak's query reads only the
    rotated dims and the output projection only the code dims; its q norm's scale is the sharpness, its post-attention
    norm's scale gives the dense target's copy / own-code ratio over the scaled embedding. Layer 0 (sliding) has
    random keys and values but a post-attention norm of 0: its output -- the drafter's context -- is the scaled
    embedding, and its keys are what layer 2 (sliding, shared) attends over: that layer's output (random queries,
    a post-attention norm of small scale) makes the next token depend on the shared window, and layer 3's random MLP
    adds departures of its own. The LM head is scaled down so the logits stay inside the soft cap."""
    m = "model.language_model."
    out = {}
    for key, v in sd.items():
        if not key.startswith(m) and key != "lm_head.weight":
            out[key] = v.clone()
        else:
            out[key] = torch.ones_like(v) if key.endswith(("norm.weight", "layer_scalar")) else torch.zeros_like(v)
    _code_embedding_and_head(out, seed, m)
    out["lm_head.weight"] *= _GEMMA_HEAD_SCALE
    d, half = _GEMMA_GLOBAL_HD, _GEMMA_GLOBAL_HD // 2
    q0, k0 = _rope_peak(COPY_PERIOD - 1)  # [_HD] in the sliding layers' rotate-half layout: pairs (j, j + 8)
    code_dims = [i for i in range(d) if i % half >= 4]  # the 24 dims no frequency rotates
    a = m + "layers.1.self_attn."
    qw, kw, ow = torch.zeros(4 * d, _H), torch.zeros(d, _H), torch.zeros(_H, 4 * d)
    for j in range(4):
        qw[j, _CONST.start] = q0[j]
        kw[j, _CONST.start], kw[j + half, _CONST.start] = k0[j], k0[j + _HD // 2]
    for i, dim in enumerate(code_dims):
        kw[dim, _CODE.start + i] = 1.0
        ow[_COPY.start + i, dim] = 1.0
    out.update({a + "q_proj.weight": qw, a + "k_proj.weight": kw, a + "o_proj.weight": ow})
    k_rms = math.sqrt((4 + 24) / d)  # the key's rms over its head (peak entries cos / sin, code entries +-1)
    out[a + "q_norm.weight"] = torch.full((d,), _TARGET_SHARPNESS * k_rms / math.sqrt(d / 4))
    # the copied code after the post-attention norm: +-sqrt(H / 24) x w; the embedding's code: +-sqrt(H)
    out[m + "layers.1.post_attention_layernorm.weight"] = torch.full((_H,), _COPY_GAIN * math.sqrt(_H)
                                                                     / math.sqrt(_H / 24))
    g = torch.Generator().manual_seed(seed + 1)
    for proj in ("k_proj", "v_proj"):
        key = m + "layers.0.self_attn." + proj + ".weight"
        out[key] = torch.randn(sd[key].shape, generator=g) * 0.25
    out[m + "layers.0.post_attention_layernorm.weight"] = torch.zeros(_H)
    for proj in ("q_proj", "o_proj"):
        key = m + "layers.2.self_attn." + proj + ".weight"
        out[key] = torch.randn(sd[key].shape, generator=g) * 0.25
    out[m + "layers.2.post_attention_layernorm.weight"] = torch.full((_H,), _GEMMA_SLIDING_DEVIATION)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        key = m + "layers.3.mlp." + proj + ".weight"
        out[key] = torch.randn(sd[key].shape, generator=g)
    out[m + "layers.3.post_feedforward_layernorm.weight"] = torch.full((_H,), _GEMMA_MLP_DEVIATION)
    out[m + "layers.3.post_attention_layernorm.weight"] = torch.zeros(_H)
    return out


# the copying target's weights of each architecture (TINY_ARCHS)
_COPYING = {"llama": _copying_target_weights, "qwen3_5": _copying_hybrid_weights,
            "qwen3_5_moe": _copying_hybrid_weights, "qwen3_moe": _copying_qwen3_moe_weights,
            "gpt_oss": _copying_gpt_oss_weights, "muse_glimmer": _copying_muse_glimmer_weights,
            "nemotron_h": _copying_nemotron_h_weights, "gemma4": _copying_gemma4_weights}
