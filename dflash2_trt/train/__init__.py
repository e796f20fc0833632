"""Distillation of DFlash 2 drafters (SPEC §5): offline data, block construction, trainer."""
