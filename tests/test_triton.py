"""Triton model repository (``dflash2-export --triton-repo``) served by the real ``tritonserver`` of the PyPI
nvidia-pytriton wheel on loopback (CPU, python backend, ONNX Runtime inside), streamed with tritonclient's gRPC
client and compared token for token with the Python runtime (``runtime.decoder.speculative_generate`` on the
same export, the server's batch loop with one request): the accepting make-tiny pair (drafts committed on most cycles) and SmolLM2-135M-Instruct with
the shipped drafter. Also: the config files
parse with tritonclient's ModelConfig (unknown fields rejected), tensorrt_plan models when engines exist,
16 concurrent streams decoded in one continuous batch with cancellations and bad requests mixed in (batch
sizes > 1 observed, every stream its own output), bad requests beside a good one, a client that disconnects
mid-stream, and a clean shutdown that leaves no process behind. Every server is started and stopped by the test
itself.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc", reason="tritonclient[grpc] is part of the dev install")

from dflash2_trt.errors import DFlash2Error  # noqa: E402
from dflash2_trt.serving.triton import server as S  # noqa: E402
from dflash2_trt.serving.triton import repo as T  # noqa: E402

MODEL = "dflash2"


# -- helpers ---------------------------------------------------------------------------------------------------
def _inputs(ids=None, text=None, max_tokens=None, temperature=None, seed=None, mode=None,  # noqa: ANN001, ANN202
            proposer=None, **sampling):  # noqa: ANN003 - SAMPLING_SCALARS by name
    from dflash2_trt.runtime.request import SAMPLING_SCALARS

    out = []

    def add(name: str, arr: np.ndarray, dtype: str) -> None:
        i = grpcclient.InferInput(name, list(arr.shape), dtype)
        i.set_data_from_numpy(arr)
        out.append(i)

    if ids is not None:
        add("input_ids", np.asarray(ids, dtype=np.int64), "INT64")
    if text is not None:
        add("text_input", np.array([text.encode()], dtype=np.object_), "BYTES")
    if max_tokens is not None:
        add("max_tokens", np.array([max_tokens], dtype=np.int32), "INT32")
    if temperature is not None:
        add("temperature", np.array([temperature], dtype=np.float32), "FP32")
    if seed is not None:
        add("seed", np.array([seed], dtype=np.int64), "INT64")
    if mode is not None:
        add("selector_mode", np.array([mode.encode()], dtype=np.object_), "BYTES")
    if proposer is not None:
        add("proposer", np.array([proposer.encode()], dtype=np.object_), "BYTES")
    for k, v in sampling.items():
        f = SAMPLING_SCALARS[k] is float
        add(k, np.array([v], dtype=np.float32 if f else np.int32), "FP32" if f else "INT32")
    return out


class Stream:
    """One gRPC client streaming one request; ``collect()`` -> dict with chunks, final, error."""

    def __init__(self, url: str, inputs: list, request_id: str = "r") -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.q.put((result, error)))
        self.client.async_stream_infer(MODEL, inputs, request_id=request_id, enable_empty_final_response=True)

    def next(self, timeout: float = 120.0) -> tuple[dict | None, str | None, bool]:
        r, e = self.q.get(timeout=timeout)
        if e is not None:
            return None, str(e), True
        final = r.get_response().parameters["triton_final_response"].bool_param
        if not r.get_response().outputs:
            return None, None, final
        return {"ids": r.as_numpy("output_ids").tolist(), "text": r.as_numpy("text_output")[0].decode(),
                "accepted": r.as_numpy("accepted").tolist(), "tau": float(r.as_numpy("tau")[0])}, None, final

    def collect(self, timeout: float = 120.0) -> dict:
        chunks, final_resp, error = [], None, None
        deadline = time.monotonic() + timeout
        while True:
            resp, error, final = self.next(max(1.0, deadline - time.monotonic()))
            if error is not None:
                break
            if final:
                final_resp = resp
                break
            chunks.append(resp)
        self.close()
        return {"chunks": chunks, "final": final_resp, "error": error}

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def run_request(url: str, **kw) -> dict:  # noqa: ANN003
    return Stream(url, _inputs(**kw)).collect()


def _tokens(out: dict) -> list[int]:
    return [t for c in out["chunks"] for t in c["ids"]]


def _metrics(srv: S.TritonServer) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def _metric_sum(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", text, flags=re.M))


def _processes_using(path: Path) -> list[str]:
    """Command lines of live processes that mention ``path`` (the server and its python stubs do)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(path) in cmd:
                out.append(cmd)
    return out


@dataclass
class Expected:
    """What the public API streams for one request decoded alone by the batch loop (``Generator.submit``, drafting
    every step: the servers here run ``speculation always``; the server decodes through it, and with drafting
    every step a sequence's chunks do not depend on what shares its steps: they must agree chunk for chunk), and
    its per-cycle acceptance."""

    chunks: list
    accepted: list[int]


def expected(export: Path, prompt: list[int], max_tokens: int, temperature: float = 0.0, seed: int = 0,
             mode: str = "greedy", proposer: str = "auto", **sampling) -> Expected:  # noqa: ANN003
    g = _generator(export)
    g.set_batching(adaptive=False)
    chunks = list(g.submit(prompt, max_tokens, temperature, seed, mode, chat=False, proposer=proposer, **sampling))
    return Expected(chunks, [c.accepted for c in chunks if c.accepted is not None])


_GENERATORS: dict = {}


def _generator(export: Path):  # noqa: ANN202
    import dflash2_trt

    if export not in _GENERATORS:
        _GENERATORS[export] = dflash2_trt.load(export, "ort", verify_checksums=False)
    return _GENERATORS[export]


def check_against_runtime(out: dict, export: Path, prompt: list[int], max_tokens: int, **kw):  # noqa: ANN003, ANN201
    """The streamed responses equal the public API's stream (returned) chunk for chunk — ids, text, acceptance
    ([] for the prefill's token and the guard's plain steps) — and the final response carries the request's
    totals; at T = 0 the tokens are the target's own (plain decoding on the same backend)."""
    assert out["error"] is None, out["error"]
    ref = expected(export, prompt, max_tokens, **kw)
    assert [c["ids"] for c in out["chunks"]] == [c.tokens for c in ref.chunks]
    assert [c["text"] for c in out["chunks"]] == [c.text for c in ref.chunks]
    assert [c["accepted"] for c in out["chunks"]] == [[] if c.accepted is None else [c.accepted] for c in ref.chunks]
    assert out["chunks"][0]["accepted"] == [] and len(out["chunks"][0]["ids"]) == 1
    assert out["final"]["ids"] == [] and out["final"]["accepted"] == ref.accepted
    tau = (sum(ref.accepted) + len(ref.accepted)) / len(ref.accepted) if ref.accepted else 0.0
    assert out["final"]["tau"] == pytest.approx(tau, rel=1e-6)
    if kw.get("temperature", 0.0) == 0.0:
        sampling = {k: v for k, v in kw.items() if k not in ("temperature", "seed", "mode", "proposer")}
        plain = _generator(export).generate(prompt, max_tokens, speculative=False, chat=False, **sampling)
        assert _tokens(out) == plain.tokens
    return ref


def serve(repo: Path, log: Path, **kw):  # noqa: ANN003, ANN201
    return S.TritonServer(repo, S.backend_dir(repo.parent), log, **kw)


def shut_down_cleanly(srv: S.TritonServer, repo: Path) -> None:
    assert srv.stop() == 0, srv.log()[-3000:]
    time.sleep(0.5)
    assert _processes_using(repo) == []
    assert "successfully unloaded 'dflash2'" in srv.log()


# -- repository + configs (no server) ---------------------------------------------------------------------------
def test_repo_configs_parse_strictly(tiny_export, tmp_path):
    repo = tmp_path / "repo"
    names = T.write_triton_repo(tiny_export, repo, instances=3, default_mode="viterbi")
    assert names == [MODEL]
    cfgs = T.summary(repo)
    c = cfgs[MODEL]
    assert c["backend"] == "python" and c["modelTransactionPolicy"] == {"decoupled": True}
    assert {i["name"] for i in c["input"]} == {"text_input", "input_ids", "max_tokens", "temperature", "seed",
                                             "selector_mode", "proposer", "top_p", "top_k", "min_p",
                                             "presence_penalty", "frequency_penalty", "repetition_penalty"}
    assert {i["name"]: i["dataType"] for i in c["input"]}["top_k"] == "TYPE_INT32"
    assert all(i["optional"] for i in c["input"])
    assert c["instanceGroup"] == [{"count": 3, "kind": "KIND_CPU"}]
    assert c["parameters"]["default_selector_mode"] == {"stringValue": "viterbi"}
    assert c["parameters"]["max_batch"] == {"stringValue": "8"}  # the batch loop's defaults
    assert c["parameters"]["speculation"] == {"stringValue": "adaptive"}
    assert c["parameters"]["default_proposer"] == {"stringValue": "auto"}  # the API's default
    assert c["parameters"]["ort_spinning"] == {"stringValue": "auto"}  # load(spinning=None)
    assert (repo / MODEL / "1" / "model.py").read_text() == T.TEMPLATE.read_text()
    # the export travels inside the repository (hard links: same inode where the filesystem allows)
    w = repo / MODEL / "1" / "export" / "weights.bin"
    assert w.read_bytes() == (tiny_export / "weights.bin").read_bytes()
    # strict parsing: an unknown field or a bad enum value is an error, not ignored
    text = (repo / MODEL / "config.pbtxt").read_text()
    with pytest.raises(DFlash2Error, match="unknown_field"):
        T.parse_config(text + "\nunknown_field: 1\n")
    with pytest.raises(DFlash2Error, match="TYPE_NOPE"):
        T.parse_config(text.replace("TYPE_INT64", "TYPE_NOPE", 1))
    # refuses a folder of ours holding files it did not write (tests/test_outdir.py: the whole rule); bad options
    # name themselves
    (repo / "notes.txt").write_text("mine")
    with pytest.raises(DFlash2Error, match="--overwrite"):
        T.write_triton_repo(tiny_export, repo)
    with pytest.raises(DFlash2Error, match="instances"):
        T.write_triton_repo(tiny_export, tmp_path / "r2", instances=0)
    with pytest.raises(DFlash2Error, match="--triton-max-batch must be >= 1"):
        T.write_triton_repo(tiny_export, tmp_path / "r2", max_batch=0)
    with pytest.raises(DFlash2Error, match="--triton-speculation must be one of adaptive, always, off, got 'x'"):
        T.write_triton_repo(tiny_export, tmp_path / "r2", speculation="x")
    with pytest.raises(DFlash2Error, match="--triton-proposer: proposer must be one of dflash2, ngram, auto, got 'x'"):
        T.write_triton_repo(tiny_export, tmp_path / "r2", proposer="x")
    with pytest.raises(DFlash2Error, match="--triton-ort-spinning"):
        T.write_triton_repo(tiny_export, tmp_path / "r2", ort_spinning="yes")
    assert not (tmp_path / "r2").exists()


def test_repo_with_engines_writes_tensorrt_plan_models(tiny_export, tmp_path):
    """An export whose manifest lists engines (stand-in plan files: no TensorRT here) gets one tensorrt_plan
    model per plan, with the plugin library beside the plugin heads and named in their parameters."""
    exp = tmp_path / "exp"
    shutil.copytree(tiny_export, exp)
    m = json.loads((exp / "manifest.json").read_text())
    (exp / "engines-x").mkdir()
    plans = {}
    for key in ("target", "drafter_context", "drafter_block", "drafter_head_greedy_plugin"):
        (exp / "engines-x" / f"{key}.plan").write_bytes(key.encode())
        plans[key] = {"file": f"engines-x/{key}.plan", "profiles": [], "build_s": 0.0}
    (exp / "engines-x" / "libdflash2_plugins.so").write_bytes(b"plugin")
    m["engines"] = {"dir": "engines-x", "tensorrt_version": "10.14.1", "gpu": {"name": "stand-in",
                    "compute_capability": "9.0"}, "plugin": {"file": "engines-x/libdflash2_plugins.so",
                    "sha256": "0" * 64}, "plans": plans}
    (exp / "manifest.json").write_text(json.dumps(m))
    repo = tmp_path / "repo"
    names = T.write_triton_repo(exp, repo)
    assert sorted(names) == sorted([MODEL] + [f"{MODEL}_{k}" for k in plans])
    cfgs = T.summary(repo)
    for key in plans:
        c = cfgs[f"{MODEL}_{key}"]
        assert c["platform"] == "tensorrt_plan"
        assert [i["name"] for i in c["input"]] == [i["name"] for i in m["graphs"][key]["inputs"]]
        assert [len(i["dims"]) for i in c["input"]] == [len(i["shape"]) for i in m["graphs"][key]["inputs"]]
        assert [o["name"] for o in c["output"]] == [o["name"] for o in m["graphs"][key]["outputs"]]
        assert (repo / f"{MODEL}_{key}" / "1" / "model.plan").read_bytes() == key.encode()
    head = cfgs[f"{MODEL}_drafter_head_greedy_plugin"]
    assert head["parameters"]["plugin_library"] == {"stringValue": "1/libdflash2_plugins.so"}
    assert (repo / f"{MODEL}_drafter_head_greedy_plugin" / "1" / "libdflash2_plugins.so").read_bytes() == b"plugin"
    assert "parameters" not in cfgs[f"{MODEL}_target"]
    # dims: symbolic ONNX dims become -1, fixed ones stay
    tgt_logits = next(o for o in cfgs[f"{MODEL}_target"]["output"] if o["name"] == "logits")
    assert tgt_logits["dims"][:2] == ["-1", "-1"] and int(tgt_logits["dims"][2]) == m["target"]["vocab_size"]


def test_cli_triton_repo_from_existing_export(tiny_export, tmp_path, capsys):
    from dflash2_trt.cli import main

    repo = tmp_path / "repo"
    assert main(["triton-repo", str(tiny_export), "--triton-repo", str(repo), "--triton-instances", "2",
                 "--triton-max-batch", "3", "--triton-speculation", "off", "--triton-proposer", "ngram",
                 "--triton-ort-spinning", "off"]) == 0
    out = capsys.readouterr().out
    assert f"wrote Triton model repository {repo}" in out and "tritonserver" in out
    c = T.summary(repo)[MODEL]
    assert c["instanceGroup"][0]["count"] == 2
    assert c["parameters"]["max_batch"] == {"stringValue": "3"} and c["parameters"]["speculation"] == {"stringValue": "off"}
    assert c["parameters"]["default_proposer"] == {"stringValue": "ngram"}
    assert c["parameters"]["ort_spinning"] == {"stringValue": "off"}
    assert main(["triton-repo", str(tiny_export), "--triton-repo", str(repo)]) == 0  # ours: replaced
    capsys.readouterr()
    (repo / "notes.txt").write_text("mine")
    assert main(["triton-repo", str(tiny_export), "--triton-repo", str(repo)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflash2: error:") and "notes.txt" in err and "--overwrite" in err and "\n" not in err


# -- the real server: the make-tiny pairs ---------------------------------------------------------------------------
def _server(export, root, instances, max_batch):  # noqa: ANN001, ANN202
    repo = root / "repo"
    T.write_triton_repo(export, repo, instances=instances, max_batch=max_batch, speculation="always", ort_threads=1,
                        ort_spinning="off")  # the model maps the parameter onto load(spinning=False)
    srv = serve(repo, root / "server.log")
    srv.start()
    try:
        yield srv
    finally:
        if srv.proc is not None and srv.proc.poll() is None:
            srv.stop()
    assert _processes_using(repo) == []


@pytest.fixture(scope="module")
def acc_server(acc_export, tmp_path_factory):
    """The accepting make-tiny pair's repository (drafts are committed on most cycles) under tritonserver: one
    instance batching up to 6 requests."""
    yield from _server(acc_export, tmp_path_factory.mktemp("triton_acc"), instances=1, max_batch=6)


@pytest.fixture(scope="module")
def tiny_server(tiny_export, tmp_path_factory):
    """The plain make-tiny pair (τ ≈ 1: long requests stay in flight long enough to be cut off mid-stream): two
    instances batching up to 4 requests each."""
    yield from _server(tiny_export, tmp_path_factory.mktemp("triton_tiny"), instances=2, max_batch=4)


def test_tiny_streams_equal_the_runtime(acc_server, acc_export):
    from helpers import assert_accepts

    url = acc_server.grpc_url
    prompt = [1, 5, 9, 22, 7]
    ref = check_against_runtime(run_request(url, ids=prompt, max_tokens=40), acc_export, prompt, 40)
    assert_accepts(ref.accepted, 15, "Triton")
    check_against_runtime(run_request(url, ids=prompt, max_tokens=20, temperature=1.0, seed=3, mode="viterbi"),
                          acc_export, prompt, 20, temperature=1.0, seed=3, mode="viterbi")
    check_against_runtime(run_request(url, ids=prompt, max_tokens=9, mode="independent"), acc_export, prompt, 9,
                          mode="independent")
    # the sampling transforms' inputs: greedy with penalties, and T = 0.8 under top-p / top-k, = the API's streams
    pen = {"presence_penalty": 2.0, "repetition_penalty": 2.0}
    pref = check_against_runtime(run_request(url, ids=prompt, max_tokens=12, **pen), acc_export, prompt, 12, **pen)
    assert [t for c in pref.chunks for t in c.tokens] != [t for c in ref.chunks for t in c.tokens][:12]  # they act
    cut = {"top_p": 0.9, "top_k": 8, "min_p": 0.01, "frequency_penalty": 0.5}
    check_against_runtime(run_request(url, ids=prompt, max_tokens=12, temperature=0.8, seed=5, **cut), acc_export,
                          prompt, 12, temperature=0.8, seed=5, **cut)
    # a request's own proposer (the drafter alone, prompt lookup alone) instead of the model's default (auto)
    refs = [check_against_runtime(run_request(url, ids=prompt * 4, max_tokens=30, proposer=who), acc_export,
                                  prompt * 4, 30, proposer=who) for who in ("dflash2", "ngram")]
    assert [c.tokens for c in refs[0].chunks] != [c.tokens for c in refs[1].chunks]  # the input made a difference
    # text in: the user message goes through the target's chat template, as the runtime's tokenizer renders it
    from dflash2_trt.runtime.tokenizer import TextTokenizer

    tok = TextTokenizer(acc_export)
    msg = "hello there"
    ids = tok.apply_chat_template([{"role": "user", "content": msg}]) if tok.chat_template else tok.encode(msg)
    check_against_runtime(run_request(url, text=msg, max_tokens=12), acc_export, ids, 12)
    # the server log says which backend runs the loop
    assert acc_server.log().count("using ONNX Runtime (CPUExecutionProvider)") == 1  # one line per instance


def test_tiny_16_concurrent_streams_share_one_batch(acc_server, acc_export):
    """16 clients at once on one instance batching 6: 11 good requests (T = 0 and T > 0, two draft modes, so two
    decoders), 3 that their clients cancel mid-stream and 2 bad ones. Every good stream equals the same request
    decoded alone chunk for chunk (greedy ones: the target's own tokens), the cancelled ones got a prefix of
    theirs and freed their slots, the bad ones got their error and nothing else; batch steps decoded several
    sequences together (the model's dflash2_batch_steps gauge)."""
    from helpers import assert_accepts

    url = acc_server.grpc_url
    before = _metrics(acc_server)
    kinds = ["good"] * 11 + ["cancel"] * 3 + ["bad"] * 2
    order = [0, 11, 1, 2, 14, 3, 4, 12, 5, 6, 7, 15, 8, 13, 9, 10]  # kinds interleaved in arrival order
    reqs = [{"ids": [1 + i, 5, 9 + 2 * i, 22], "max_tokens": 10 + i % 7, "temperature": (0.0, 0.8)[i % 2],
             "seed": i, "mode": ("greedy", "viterbi")[i // 2 % 2]} for i in range(11)]
    reqs += [{"ids": [2 + i, 3, 4], "max_tokens": 400} for i in range(3)]  # cancelled after 3 responses
    reqs += [{"ids": [1, 10**6], "max_tokens": 5}, {"ids": [1, 2], "mode": "bogus"}]
    results: list = [None] * 16
    start = threading.Barrier(16)

    def client(i: int) -> None:
        start.wait()
        s = Stream(url, _inputs(**reqs[i]), request_id=f"r{i}")
        if kinds[i] != "cancel":
            results[i] = s.collect()
            return
        got = [s.next() for _ in range(3)]
        s.close(cancel=True)
        results[i] = got

    threads = [threading.Thread(target=client, args=(i,)) for i in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    greedy = []
    for i, out in enumerate(results):
        if kinds[i] == "good":
            r = reqs[i]
            ref = check_against_runtime(out, acc_export, r["ids"], r["max_tokens"], temperature=r["temperature"],
                                        seed=r["seed"], mode=r["mode"])
            greedy += ref.accepted if r["temperature"] == 0 else []
        elif kinds[i] == "cancel":
            assert all(err is None and resp is not None for resp, err, _ in out), out
            ids = [t for resp, _, _ in out for t in resp["ids"]]
            ref = [t for c in expected(acc_export, reqs[i]["ids"], 400).chunks for t in c.tokens]
            assert ids == ref[:len(ids)]
        else:
            assert out["chunks"] == [] and out["error"] is not None
    assert "out of range" in results[14]["error"] and "draft mode must be one of" in results[15]["error"]
    assert_accepts(greedy, 8, "16 clients, T = 0")
    deadline = time.monotonic() + 60
    while _metric_sum(_metrics(acc_server), "dflash2_active_requests") and time.monotonic() < deadline:
        time.sleep(0.2)  # the cancelled requests' forwarders notice within 0.1 s
    text = _metrics(acc_server)
    assert _metric_sum(text, "dflash2_active_requests") == 0
    assert _metric_sum(text, "dflash2_cancelled_requests") == _metric_sum(before, "dflash2_cancelled_requests") + 3
    assert _metric_sum(text, "dflash2_requests") == _metric_sum(before, "dflash2_requests") + 14
    sizes = {int(k): float(v) for k, v in re.findall(r'^dflash2_batch_steps{[^}]*size="(\d+)"[^}]*} (\S+)$', text,
                                                      flags=re.M)}
    assert sum(v for k, v in sizes.items() if k > 1) > 0 and max(sizes) <= 6, sizes  # batching happened
    # every slot is free again: 6 new requests decode together and equal their references
    again = [threading.Thread(target=lambda i=i: results.__setitem__(i, run_request(url, **reqs[i])))
             for i in range(6)]
    for t in again:
        t.start()
    for t in again:
        t.join(timeout=300)
    for i in range(6):
        check_against_runtime(results[i], acc_export, reqs[i]["ids"], reqs[i]["max_tokens"],
                              temperature=reqs[i]["temperature"], seed=reqs[i]["seed"], mode=reqs[i]["mode"])
    assert "Stub process" not in acc_server.log()


BAD = [  # (request, part of the error message)
    ({"max_tokens": 5}, "give exactly one of the inputs"),
    ({"ids": [1, 2], "text": "both"}, "give exactly one of the inputs"),
    ({"ids": [1] * 600, "max_tokens": 5}, "does not fit the 512 positions"),
    ({"ids": [1, 2], "max_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),  # GenerationRequest's check
    ({"ids": [1, 2], "max_tokens": 513}, "max_tokens must be at most 512"),  # the deployment's max_tokens_limit
    ({"ids": [1, 2], "temperature": -1.0}, "temperature must be a finite number >= 0"),
    ({"ids": [1, 2], "temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"ids": [1, 2], "seed": -4}, "seed must be an integer >= 0"),
    ({"ids": [1, 2], "mode": "bogus"}, "draft mode must be one of greedy, viterbi, independent, got 'bogus'"),
    ({"ids": [1, 10**6]}, "prompt token id 1000000 out of range"),
    ({"ids": [1, 2], "proposer": "lookahead"}, "proposer must be one of dflash2, ngram, auto, got 'lookahead'"),
]


def test_tiny_bad_requests_error_while_a_good_one_streams(tiny_server, tiny_export):
    url = tiny_server.grpc_url
    good = Stream(url, _inputs(ids=[3, 4, 5], max_tokens=500), request_id="good")
    first, err, _ = good.next()
    assert err is None and first is not None
    for i, (req, msg) in enumerate(BAD):
        out = run_request(url, **req)
        assert out["error"] is not None and msg in out["error"], (req, out["error"])
        assert out["chunks"] == []
        if i == 0:  # the good request was still decoding on the other instance meanwhile
            assert _metric_sum(_metrics(tiny_server), "dflash2_active_requests") == 1
    # a wrong input type and an unknown input are refused by Triton itself, before the model
    x = grpcclient.InferInput("input_ids", [2], "FP32")
    x.set_data_from_numpy(np.array([1, 2], dtype=np.float32))
    y = grpcclient.InferInput("prompt", [1], "INT64")
    y.set_data_from_numpy(np.array([1], dtype=np.int64))
    for inputs, msg in (([x], "data-type is 'FP32', but model 'dflash2' expects 'INT64'"),
                        ([y], "unexpected inference input 'prompt'")):
        out = Stream(url, inputs).collect()
        assert out["error"] is not None and msg in out["error"], out["error"]
    rest = good.collect()
    out = {"chunks": [first] + rest["chunks"], "final": rest["final"], "error": rest["error"]}
    check_against_runtime(out, tiny_export, [3, 4, 5], 500)
    assert "Stub process" not in tiny_server.log()  # no instance died


CLIENT = """
import os, queue, sys, numpy as np, tritonclient.grpc as g
c = g.InferenceServerClient(sys.argv[1]); q = queue.Queue()
c.start_stream(callback=lambda result, error: q.put((result, error)))
i = g.InferInput("input_ids", [3], "INT64"); i.set_data_from_numpy(np.array([2, 3, 4], np.int64))
m = g.InferInput("max_tokens", [1], "INT32"); m.set_data_from_numpy(np.array([500], np.int32))
c.async_stream_infer("dflash2", [i, m], request_id=sys.argv[2])
for _ in range(3):
    r, e = q.get(timeout=60)
    assert e is None, e
print("got 3", flush=True)
if sys.argv[3] == "cancel":
    c.stop_stream(cancel_requests=True)
os._exit(0)  # no goodbye: the connection just drops
"""


def test_tiny_client_that_disconnects_frees_its_state(tiny_server, tiny_export):
    url = tiny_server.grpc_url
    before = _metric_sum(_metrics(tiny_server), "dflash2_cancelled_requests")
    for rid, how in (("dropped", "drop"), ("cancelled", "cancel")):
        r = subprocess.run([sys.executable, "-c", CLIENT, url, rid, how], capture_output=True, text=True, timeout=120,
                           env={**os.environ})
        assert r.returncode == 0 and "got 3" in r.stdout, r.stderr[-2000:]
        deadline = time.monotonic() + 60
        while f"request '{rid}' cancelled after" not in tiny_server.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert f"request '{rid}' cancelled after" in tiny_server.log()
    # the forwarder logs the cancel, then frees the slot and lowers the gauge: wait for the gauge, not the log
    deadline = time.monotonic() + 60
    while _metric_sum(text := _metrics(tiny_server), "dflash2_active_requests") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _metric_sum(text, "dflash2_cancelled_requests") == before + 2
    assert _metric_sum(text, "dflash2_active_requests") == 0
    # the instances serve on
    check_against_runtime(run_request(url, ids=[2, 3, 4], max_tokens=8), tiny_export, [2, 3, 4], 8)


def test_tiny_full_instance_leaves_requests_to_the_other(tiny_server, tiny_export):
    """Two instances batching 4 each, 10 requests at once: an instance holding 4 takes no more (its execute waits),
    so both instances decode some, and neither ever held more than 4 (its peak gauge); every stream equals its
    reference."""
    url = tiny_server.grpc_url
    before = dict(re.findall(r'^dflash2_requests{instance="(\w+)",model="dflash2"} (\S+)$', _metrics(tiny_server),
                             flags=re.M))
    prompts = [[3 + i, 4, 5 + i] for i in range(10)]
    outs: list = [None] * 10
    threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, run_request(url, ids=prompts[i], max_tokens=40)))
               for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    for p, out in zip(prompts, outs):
        check_against_runtime(out, tiny_export, p, 40)
    after = dict(re.findall(r'^dflash2_requests{instance="(\w+)",model="dflash2"} (\S+)$', _metrics(tiny_server),
                            flags=re.M))
    served = {k: float(v) - float(before.get(k, 0)) for k, v in after.items()}
    assert set(served) == {"dflash2_0_0", "dflash2_0_1"} and all(v > 0 for v in served.values()), served
    assert sum(served.values()) == 10
    # the admission cap: no instance held more than its max_batch (4) at once, and one was full
    peaks = dict(re.findall(r'^dflash2_active_requests_peak{instance="(\w+)",model="dflash2"} (\S+)$',
                            _metrics(tiny_server), flags=re.M))
    assert set(peaks) == set(served) and max(float(v) for v in peaks.values()) == 4, peaks


def test_tiny_servers_shut_down_cleanly(tiny_server, acc_server):
    """Last of the tiny-server tests: SIGINT stops each server (exit code 0), the models unload and no stub
    or server process is left."""
    for srv in (tiny_server, acc_server):
        shut_down_cleanly(srv, srv.repo)


def test_model_refuses_to_load_under_numpy2(tiny_export, tmp_path):
    """Without the NumPy 1.x folder first on its path the python backend would send empty tensors: the model
    refuses to load instead, and the server stops with that reason."""
    import site

    repo = tmp_path / "repo"
    T.write_triton_repo(tiny_export, repo, verify_checksums=False)
    srv = serve(repo, tmp_path / "server.log", timeout=60)
    srv.env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parent.parent), *site.getsitepackages()])
    with pytest.raises(DFlash2Error, match="exited"):
        srv.start()
    assert "the python backend needs NumPy 1.x" in srv.log()
    assert _processes_using(repo) == []


# -- the real server: SmolLM2-135M-Instruct + the shipped drafter -------------------------------------------------
@pytest.mark.slow
def test_smollm2_shipped_drafter_streams_equal_the_runtime(tmp_path):
    from dflash2_trt.bench.demo import DEMO_DRAFT_VOCAB, DEMO_MAX_SEQ_LEN, demo_drafter_path
    from dflash2_trt.export.cache import cached_export
    from dflash2_trt.runtime.tokenizer import TextTokenizer

    export = cached_export("smollm2", demo_drafter_path(), progress=False, max_seq_len=DEMO_MAX_SEQ_LEN,
                           draft_vocab=DEMO_DRAFT_VOCAB)  # = the demo's export
    repo = tmp_path / "repo"
    T.write_triton_repo(export, repo, instances=1, verify_checksums=False, speculation="always")
    tok = TextTokenizer(export)
    cases = [("What is the capital of France?", {"max_tokens": 32}),
             ("Write a Python function that reverses a string.", {"max_tokens": 32, "mode": "viterbi"}),
             ("List three colors.", {"max_tokens": 24, "temperature": 0.7, "seed": 11})]
    accepted = []
    with serve(repo, tmp_path / "server.log") as srv:
        for text, kw in cases:
            out = run_request(srv.grpc_url, text=text, **kw)
            ids = tok.apply_chat_template([{"role": "user", "content": text}])
            check_against_runtime(out, export, ids, kw["max_tokens"], temperature=kw.get("temperature", 0.0),
                                  seed=kw.get("seed", 0), mode=kw.get("mode", "greedy"))
            accepted += out["final"]["accepted"]
        assert max(accepted) >= 1  # the trained drafter's drafts are accepted (multi-token chunks streamed)
        assert "using ONNX Runtime" in srv.log()
        shut_down_cleanly(srv, repo)
