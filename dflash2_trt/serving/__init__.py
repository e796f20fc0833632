"""Serving: the runtime behind a network endpoint, in two faces.

* ``http`` -- ``dflash2 serve``, the OpenAI-compatible HTTP server over the batched runtime (request checks and
  bodies, the ASGI application and its metrics, tool calls);
* ``triton`` -- Triton Inference Server: the model repository ``dflash2 triton-repo`` and ``dflash2 export
  --triton-repo`` write (``repo``, with the python-backend model file in ``templates/``) and the bundled CPU
  ``tritonserver`` that serves it (``server``).

Both decode through the public API (:mod:`dflash2_trt.api`: ``Generator.submit``), never a backend directly. Owns
nothing beyond its two faces; each says what it may import (the HTTP face: the ``serve`` extra only inside its
application and command; the Triton face: ``tritonclient`` only while writing a repository).
"""
