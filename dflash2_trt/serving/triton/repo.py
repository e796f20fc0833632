"""Triton Inference Server model repository for an export folder, and the bundled server that serves it.

    dflash2 export --target T --drafter D --out EXPORT --triton-repo DIR [triton options]   (= dflash2-export ...)
    dflash2 triton-repo EXPORT --triton-repo DIR [triton options]                           (an existing export)

    triton options: --triton-model-name NAME (dflash2) --triton-instances N (1) --triton-backend auto|ort|trt
                    --triton-selector greedy|viterbi|independent --triton-max-tokens N (128: a request's default)
                    --triton-max-batch N (8) --triton-speculation adaptive|always|off
                    --triton-proposer dflash2|ngram|auto (auto: a request's default)

Layout (written into a temporary folder beside DIR and moved into place whole; an existing DIR is replaced
only when it is a repository we wrote, see :mod:`dflash2_trt.outdir`)::

    DIR/dflash2-repo.json            the files we wrote (Triton reads model folders only)

    DIR/<name>/config.pbtxt          python backend, decoupled (token streaming), inputs/outputs/parameters
    DIR/<name>/1/model.py            templates/dflash2_model.py: the DFlash 2 loop over
                                     ``runtime.open_backend`` (TensorRT when the engines load, else ONNX Runtime;
                                     the choice is logged by the server)
    DIR/<name>/1/export/             the export folder (hard links where the filesystem allows, else copies)
    DIR/<name>_<graph>/config.pbtxt  only when the export has TensorRT engines: one ``tensorrt_plan`` model per
    DIR/<name>_<graph>/1/model.plan  plan (target, drafter context / block / heads) for pipelines composed by
                                     hand (BLS); the drafter heads list the plugin library in their parameters
                                     and it sits beside their plan. These need a GPU and TensorRT: the bundled
                                     CPU server cannot load them.

Every config.pbtxt is built as a ``tritonclient`` ``ModelConfig`` protobuf message and checked by parsing the
written text back (protobuf text format rejects unknown fields).

Serving the repository (the bundled server, its command and environment) is :mod:`dflash2_trt.serving.triton.server`'s.

Concurrency: each instance decodes all the requests it holds in one continuous batch (``Generator.submit``: up
to ``--triton-max-batch`` sequences share each step, more wait for a slot; ``--triton-speculation``: drafting
load-adaptive, every step, or never; ``--triton-proposer``: who drafts for a request that does not say, the
drafter, prompt lookup or per cycle whichever pays, as :meth:`dflash2_trt.api.Generator.generate`);
``instance_group`` count (``--triton-instances``) adds independent
instances, each with its own runners and caches (``--triton-max-batch 1 --triton-instances N``: N requests at a
time, each decoded alone).
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

from dflash2_trt import validate as V
from dflash2_trt.errors import DFlash2Error
from dflash2_trt.manifest import GraphSpec, read_manifest
from dflash2_trt.outdir import TempFolder, check_replace, repo_owner, write_error, write_repo_record
from dflash2_trt.runtime.request import SAMPLING_SCALARS, GenerationRequest
from dflash2_trt.vocabulary import (BACKEND_CHOICES, DEFAULT_PROPOSER, DRAFT_MODES, ORT_SPINNING, PROPOSERS,
                                    SPECULATION_MODES)

TEMPLATE = Path(__file__).resolve().parent / "templates" / "dflash2_model.py"
DEFAULT_MODEL_NAME = "dflash2"
EXPORT_SUBDIR = "export"
_TRT_TYPES = {"float32": "TYPE_FP32", "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "int64": "TYPE_INT64",
              "int32": "TYPE_INT32", "bool": "TYPE_BOOL"}
# the python model's interface (see the template's docstring): name, type, dims
_INPUTS = (("text_input", "TYPE_STRING", [1]), ("input_ids", "TYPE_INT64", [-1]), ("max_tokens", "TYPE_INT32", [1]),
           ("temperature", "TYPE_FP32", [1]), ("seed", "TYPE_INT64", [1]), ("selector_mode", "TYPE_STRING", [1]),
           ("proposer", "TYPE_STRING", [1]),
           *((n, "TYPE_FP32" if t is float else "TYPE_INT32", [1]) for n, t in SAMPLING_SCALARS.items()))
_OUTPUTS = (("output_ids", "TYPE_INT64", [-1]), ("text_output", "TYPE_STRING", [1]), ("accepted", "TYPE_INT32", [-1]),
            ("tau", "TYPE_FP32", [1]))


def _pb():  # noqa: ANN202
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        raise DFlash2Error("writing a Triton repository needs tritonclient: "
                           "pip install 'dflash2-trt[triton]'") from None
    return model_config_pb2, text_format


def parse_config(text: str) -> Any:
    """config.pbtxt text -> ``ModelConfig``; unknown fields or bad values raise DFlash2Error."""
    pb, text_format = _pb()
    try:
        return text_format.Parse(text, pb.ModelConfig())
    except text_format.ParseError as e:
        raise DFlash2Error(f"invalid Triton model config: {e}") from None


def _write_config(model_dir: Path, cfg: Any) -> None:
    _, text_format = _pb()
    text = text_format.MessageToString(cfg)
    if parse_config(text) != cfg:  # the written text must say exactly what was built
        raise DFlash2Error(f"{model_dir.name}/config.pbtxt does not round-trip through the ModelConfig parser")
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(text)


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def _copy_tree(src: Path, dst: Path) -> None:
    for p in sorted(src.rglob("*")):
        if p.is_file():
            _link_or_copy(p, dst / p.relative_to(src))


def python_model_config(name: str, instances: int, backend: str, default_mode: str, default_max_tokens: int,
                        max_tokens_limit: int, ort_threads: int, verify_checksums: bool, max_batch: int = 8,
                        speculation: str = "adaptive", proposer: str = DEFAULT_PROPOSER,
                        ort_spinning: str = "auto") -> Any:
    pb, _ = _pb()
    cfg = pb.ModelConfig(name=name, backend="python", max_batch_size=0)
    cfg.model_transaction_policy.decoupled = True
    for n, t, dims in _INPUTS:
        cfg.input.add(name=n, data_type=pb.DataType.Value(t), dims=dims, optional=True)
    for n, t, dims in _OUTPUTS:
        cfg.output.add(name=n, data_type=pb.DataType.Value(t), dims=dims)
    # KIND_CPU: the stub process picks its own device (TensorRT / CUDA EP) through the runtime
    cfg.instance_group.add(count=instances, kind=pb.ModelInstanceGroup.Kind.KIND_CPU)
    params = {"export_dir": EXPORT_SUBDIR, "backend": backend, "default_selector_mode": default_mode,
              "default_max_tokens": str(default_max_tokens), "max_tokens_limit": str(max_tokens_limit),
              "ort_threads": str(ort_threads), "verify_checksums": "true" if verify_checksums else "false",
              "max_batch": str(max_batch), "speculation": speculation, "default_proposer": proposer,
              "ort_spinning": ort_spinning}
    for k, v in params.items():
        cfg.parameters[k].string_value = v
    return cfg


def _trt_dims(shape: tuple) -> list[int]:
    return [d if isinstance(d, int) else -1 for d in shape]


def plan_model_config(name: str, graph: GraphSpec, plugin_file: str | None) -> Any:
    """A ``tensorrt_plan`` model for one engine; IO names/types/dims from the export manifest's graph entry."""
    pb, _ = _pb()
    cfg = pb.ModelConfig(name=name, platform="tensorrt_plan", max_batch_size=0, default_model_filename="model.plan")
    for io, field in ((graph.inputs, cfg.input), (graph.outputs, cfg.output)):
        for t in io:
            if t.dtype not in _TRT_TYPES:
                raise DFlash2Error(f"tensor {t.name!r} of {name}: dtype {t.dtype!r} has no Triton type")
            field.add(name=t.name, data_type=pb.DataType.Value(_TRT_TYPES[t.dtype]), dims=_trt_dims(t.shape))
    cfg.instance_group.add(count=1, kind=pb.ModelInstanceGroup.Kind.KIND_GPU)
    if plugin_file:
        # the TensorRT backend loads plugins from --backend-config=tensorrt,plugins=...; recorded here so a
        # pipeline author finds the library (it sits beside the plan)
        cfg.parameters["plugin_library"].string_value = plugin_file
    return cfg


def write_triton_repo(export_dir: str | Path, repo_dir: str | Path, *, model_name: str = DEFAULT_MODEL_NAME,
                      instances: int = 1, backend: str = "auto", default_mode: str = "greedy",
                      default_max_tokens: int = 128, ort_threads: int = 0, verify_checksums: bool = True,
                      max_batch: int = 8, speculation: str = "adaptive", proposer: str = DEFAULT_PROPOSER,
                      ort_spinning: str = "auto", overwrite: bool = False) -> list[str]:
    """Write the model repository for ``export_dir`` into ``repo_dir``; returns the model names written.
    ``ort_spinning``: the instances' ``load(spinning=...)`` (:data:`~dflash2_trt.vocabulary.ORT_SPINNING`);
    ``overwrite``: replace a repository of ours that holds files its record does not list (named first)."""
    export_dir, repo = Path(export_dir), Path(repo_dir)
    m = read_manifest(export_dir, verify_checksums=False)  # the server's instances verify them when they load
    if instances < 1:
        raise DFlash2Error(f"--triton-instances must be >= 1, got {instances}")
    if backend not in BACKEND_CHOICES:
        raise DFlash2Error(f"--triton-backend must be one of {', '.join(BACKEND_CHOICES)}, got {backend!r}")
    if max_batch < 1:
        raise DFlash2Error(f"--triton-max-batch must be >= 1, got {max_batch}")
    if speculation not in SPECULATION_MODES:
        raise DFlash2Error(f"--triton-speculation must be one of {', '.join(SPECULATION_MODES)}, got {speculation!r}")
    if ort_spinning not in ORT_SPINNING:
        raise DFlash2Error(f"--triton-ort-spinning must be one of {', '.join(ORT_SPINNING)}, got {ort_spinning!r}")
    # the requests' defaults: the fields of the GenerationRequest the model builds from them at load
    for flag, field, value in (("--triton-max-tokens", "max_new_tokens", default_max_tokens),
                               ("--triton-proposer", "proposer", proposer)):
        try:
            GenerationRequest(**{field: value})
        except DFlash2Error as e:
            raise DFlash2Error(f"{flag}: {e}") from None
    m.check_draft_mode(default_mode)
    if default_max_tokens > m.max_seq_len:
        raise DFlash2Error(f"--triton-max-tokens must be at most {m.max_seq_len} (the export's positions), got "
                           f"{default_max_tokens}")
    check_replace(repo, "--triton-repo", repo_owner, overwrite)
    try:
        with TempFolder(repo, "triton") as t:
            names = _write_repo(t.path, export_dir, m, model_name, instances, backend, default_mode,
                                default_max_tokens, ort_threads, verify_checksums, max_batch, speculation, proposer,
                                ort_spinning)
            write_repo_record(t.path)
            if not overwrite:
                check_replace(repo, "--triton-repo", repo_owner)  # again: it may have changed meanwhile
            t.publish()
    except OSError as e:
        raise write_error(e, repo) from None
    return names


def _write_repo(tmp: Path, export_dir: Path, m, model_name: str, instances: int, backend: str,  # noqa: ANN001
                default_mode: str, default_max_tokens: int, ort_threads: int, verify_checksums: bool, max_batch: int,
                speculation: str, proposer: str = DEFAULT_PROPOSER, ort_spinning: str = "auto") -> list[str]:
    """Build the repository in ``tmp``; returns the model names."""
    names = [model_name]
    mdir = tmp / model_name
    _write_config(mdir, python_model_config(model_name, instances, backend, default_mode, default_max_tokens,
                                            m.max_seq_len, ort_threads, verify_checksums, max_batch, speculation,
                                            proposer, ort_spinning))
    (mdir / "1").mkdir()
    shutil.copy2(TEMPLATE, mdir / "1" / "model.py")
    _copy_tree(export_dir, mdir / "1" / EXPORT_SUBDIR)
    if m.engines is not None:
        plug = m.engines.plugin.file if m.engines.plugin else None
        for key, plan in sorted(m.engines.plans.items()):
            name = f"{model_name}_{key}"
            lib = Path(plug).name if plug and m.graphs[key].selector == "plugin" else None
            _write_config(tmp / name, plan_model_config(name, m.graphs[key], f"1/{lib}" if lib else None))
            _link_or_copy(export_dir / plan.file, tmp / name / "1" / "model.plan")
            if lib:
                _link_or_copy(export_dir / plug, tmp / name / "1" / lib)
            names.append(name)
    return names


# -- CLI ----------------------------------------------------------------------------------------------------
def add_triton_options(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--triton-repo", required=required, metavar="DIR",
                   help="write a Triton Inference Server model repository to DIR")
    p.add_argument("--triton-model-name", default=DEFAULT_MODEL_NAME)
    p.add_argument("--triton-instances", type=V.integer(1, 1024), default=1, help="model instances (concurrent requests)")
    p.add_argument("--triton-backend", choices=BACKEND_CHOICES, default="auto",
                   help="runtime backend inside the server")
    p.add_argument("--triton-selector", choices=DRAFT_MODES, default="greedy",
                   help="default selector mode (a request may choose another)")
    p.add_argument("--triton-max-tokens", type=V.COUNT, default=128, help="default max tokens of a request")
    p.add_argument("--triton-max-batch", type=V.integer(1, 1024), default=8,
                   help="requests an instance decodes together in one continuous batch (more wait for a slot)")
    p.add_argument("--triton-speculation", choices=SPECULATION_MODES, default="adaptive",
                   help="drafting in the batch: while the load-adaptive rule says it pays, every step, or never")
    p.add_argument("--triton-proposer", choices=PROPOSERS, default=DEFAULT_PROPOSER,
                   help="who drafts for a request that does not say (its input 'proposer'): the DFlash 2 drafter, "
                        "prompt lookup, or per cycle whichever pays")
    p.add_argument("--triton-ort-spinning", choices=tuple(ORT_SPINNING), default="auto",
                   help="ONNX Runtime: whether an instance's target session spins between ops (off: several "
                        "instances or servers on one CPU; auto: on, or $DFLASH2_ORT_SPINNING)")


def run_write(export_dir: str | Path, a: argparse.Namespace) -> int:
    """``dflash2 triton-repo`` / ``dflash2 export --triton-repo``: write the repository from parsed options and
    print what was written (user errors raise DFlash2Error: one line from the CLI)."""
    names = write_triton_repo(export_dir, a.triton_repo, model_name=a.triton_model_name, instances=a.triton_instances,
                              backend=a.triton_backend, default_mode=a.triton_selector,
                              default_max_tokens=a.triton_max_tokens, max_batch=a.triton_max_batch,
                              speculation=a.triton_speculation, proposer=a.triton_proposer,
                              ort_spinning=a.triton_ort_spinning,
                              overwrite=getattr(a, "overwrite", False))
    print(f"wrote Triton model repository {a.triton_repo} (models: {', '.join(names)})")
    return 0


def summary(repo: str | Path) -> dict[str, Any]:
    """{model name: parsed config as a dict} of a written repository (for tests and tools)."""
    from google.protobuf.json_format import MessageToDict

    return {c.parent.name: MessageToDict(parse_config(c.read_text()))
            for c in sorted(Path(repo).glob("*/config.pbtxt"))}
