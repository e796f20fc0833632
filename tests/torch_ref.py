"""The PyTorch reference decode of one prompt for tests: a HF :class:`TargetModel` and a draft runner through
:mod:`dflash2_trt.runtime.decoder` (the loop every backend shares), with the oracle top-K count on."""

from __future__ import annotations

from dflash2_trt.bench.oracle import oracle_count
from dflash2_trt.runtime import decoder
from dflash2_trt.runtime.decoder import GenerationResult
from dflash2_trt.runtime.request import GenerationRequest
from dflash2_trt.runtime.torch.backend import TorchTargetRunner


def ref_autoregressive(target, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,  # noqa: ANN001
                       eos_ids: set[int] | None = None, seed: int = 0) -> GenerationResult:
    request = GenerationRequest(max_new_tokens=max_new_tokens, temperature=temperature, eos_ids=eos_ids, seed=seed)
    return decoder.target_generate(TorchTargetRunner(target), prompt_ids, request)


def ref_speculative(target, source, prompt_ids: list[int], request: GenerationRequest,  # noqa: ANN001
                    layer_ids: list[int] | None = None) -> GenerationResult:
    """``layer_ids``: target layers feeding the drafter."""
    return decoder.speculative_generate(TorchTargetRunner(target, layer_ids), source, prompt_ids, request,
                                        decoder.DecodeHooks(oracle=oracle_count))
