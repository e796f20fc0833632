"""``dflash2 serve``: an OpenAI-compatible HTTP server over the batched runtime (:meth:`dflash2_trt.api.Generator.submit`).

Owns the HTTP side of serving: the OpenAI request checks and response bodies (:mod:`.protocol`, standard library
only), the ASGI application and its Prometheus metrics (:mod:`.app`: Starlette, prometheus_client) and the
``serve`` subcommand (:mod:`.cli`: its flags, then uvicorn with a SIGTERM drain). Every request decodes through the
public API (:mod:`dflash2_trt.api`), never a backend directly.

It may import :mod:`dflash2_trt.api`, :mod:`dflash2_trt.errors`, :mod:`dflash2_trt.validate` and
:mod:`dflash2_trt.vocabulary`; the ``serve`` extra (starlette, uvicorn, prometheus_client) only in :mod:`.app` and
inside :func:`.cli.run`, so ``dflash2 --help`` and the CLI's parser work on a base install.
"""
