"""Focused stub: only what dflash2_trt uses (see bindings/runtime.pyi)."""
