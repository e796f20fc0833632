"""The Triton Inference Server face of serving: ``repo`` writes a model repository for an export folder (a
python-backend model, ``templates/dflash2_model.py``, decoding through the public API in one continuous batch per
instance, and ``tensorrt_plan`` models for the engines), ``server`` finds and runs the bundled CPU ``tritonserver``
of the ``nvidia-pytriton`` wheel on it.

May import :mod:`dflash2_trt.errors`, :mod:`dflash2_trt.manifest`, :mod:`dflash2_trt.outdir`,
:mod:`dflash2_trt.paths`, :mod:`dflash2_trt.validate`, :mod:`dflash2_trt.vocabulary` and
:mod:`dflash2_trt.runtime.request`; ``tritonclient`` (the ``triton`` extra) only inside ``repo``'s writer. The
template is package data, loaded by Triton's python backend, not imported here.
"""
