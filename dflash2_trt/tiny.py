"""``make-tiny``: a small random-weight Llama-style target (with a locally built tokenizer) and a matching
random DFlash 2 drafter, for smoke tests of any pipeline. Nothing is downloaded.

Layout written::

    OUT/target/   config.json, model.safetensors, tokenizer.json, tokenizer_config.json, ...
    OUT/drafter/  config.json, model.safetensors
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from dflash2_trt.config import DFlash2Config

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


def make_tiny(out: str | os.PathLike, seed: int = 0, block_size: int = 16) -> tuple[Path, Path]:
    """Write OUT/target and OUT/drafter (atomically: built in a temp folder, moved into place)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash2_trt.model import DFlash2Drafter, save_drafter

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    tok = build_tokenizer()
    vocab = len(tok)
    tcfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                       rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=None, eos_token_id=0,
                       pad_token_id=0, initializer_range=0.2)
    target = LlamaForCausalLM(tcfg).eval()
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
    (out / "README.txt").write_text(json.dumps({"made_by": "dflash2 make-tiny", "seed": seed}) + "\n")
    return out / "target", out / "drafter"
