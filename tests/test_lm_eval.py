"""lm-evaluation-harness's ``local-completions`` model on a local multiple-choice task (tests/data/lm_eval: a
loglikelihood task, its documents in a JSON-lines file) end to end against ``dflash2 serve`` on the demo's export:
lm-eval tokenizes with the export's tokenizer, sends the token ids four prompts per request with ``echo``,
``logprobs = 1`` and ``max_tokens = 1``, and reads each continuation's loglikelihood from the prompt logprobs. Every
(context, continuation) loglikelihood and its is-greedy flag equal the target's own, computed here by transformers
on the SmolLM2 checkpoint the export was made from; the task's accuracy is the reference's. Negative control: the server's logprobs read one row off (each token given
the next row's) is caught by the comparison."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from test_serve import KEY, NAME, _Server, export  # noqa: F401 - fixtures

lm_eval = pytest.importorskip("lm_eval", reason="the dev extra installs lm-eval")

TASKS = Path(__file__).parent / "data" / "lm_eval"


@pytest.fixture(scope="module")
def server(export, tmp_path_factory):  # noqa: F811
    s = _Server(export, tmp_path_factory.mktemp("serve"), "--api-key", KEY, "--max-batch", "4")
    yield s
    s.stop()


def _reference(pairs: list[tuple[str, str]], tokenizer) -> list[tuple[float, bool]]:  # noqa: ANN001
    """(context, continuation) -> (sum of the continuation tokens' log-softmax, each its row's argmax), from
    transformers' forward of the SmolLM2 checkpoint in float64, the pair tokenized as lm-eval does (the whole text,
    the context's tokens first)."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash2_trt.targets.adapter import smollm2_path

    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), torch_dtype=torch.float64).eval()
    out = []
    for ctx, cont in pairs:
        whole = tokenizer(ctx + cont, add_special_tokens=False).input_ids
        n_ctx = len(tokenizer(ctx, add_special_tokens=False).input_ids)
        with torch.no_grad():
            logits = model(torch.tensor([whole])).logits[0]  # [len(whole), V]
        lp = torch.log_softmax(logits, -1).numpy()
        rows, toks = np.arange(n_ctx - 1, len(whole) - 1), np.array(whole[n_ctx:])
        out.append((float(lp[rows, toks].sum()), bool((lp[rows].argmax(-1) == toks).all())))
    return out


def test_local_completions_multiple_choice_equals_the_target(server, export, tmp_path, monkeypatch):  # noqa: F811
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.chdir(TASKS)  # the task's data_files path is relative
    sent, plant = [], []
    real_post = __import__("requests").post

    def spy(url, json=None, **kw):  # noqa: ANN001, ANN202, A002 - what lm-eval sends, then sent on
        sent.append(json)
        r = real_post(url, json=json, **kw)
        if plant:  # the negative control: each token given the logprob of the row after its own
            body = r.json()
            for c in body["choices"]:
                c["logprobs"]["token_logprobs"] = [None, *c["logprobs"]["token_logprobs"][2:], 0.0]
            r._content = __import__("json").dumps(body).encode()
        return r

    monkeypatch.setattr("requests.post", spy)

    def evaluate() -> dict:
        return simple_evaluate(
            model="local-completions",
            model_args={"base_url": server.url + "/v1/completions", "model": NAME, "tokenizer_backend": "huggingface",
                        "tokenizer": str(export), "batch_size": 4, "num_concurrent": 1, "max_retries": 1},
            tasks=["dflash2_mc"], task_manager=TaskManager(include_path=str(TASKS)), log_samples=True,
            random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)

    res = evaluate()
    samples = res["samples"]["dflash2_mc"]
    assert len(samples) == 5
    # the path taken: token-id prompts, several per request, with echo and logprobs (the loglikelihood route)
    assert sent and all(b["echo"] and b["logprobs"] == 1 and b["max_tokens"] == 1 for b in sent)
    assert any(len(b["prompt"]) > 1 and isinstance(b["prompt"][0], list) for b in sent)
    pairs = [tuple(a) for s in samples for a in s["arguments"]]
    got = [tuple(r[0]) for s in samples for r in s["resps"]]
    want = _reference(pairs, AutoTokenizer.from_pretrained(str(export)))
    assert len(got) == len(want) == sum(len(s["doc"]["choices"]) for s in samples) == 18
    np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], atol=2e-3, rtol=1e-4)
    assert [bool(g[1]) for g in got] == [w[1] for w in want]
    acc, k = [], 0
    for s in samples:
        n = len(s["doc"]["choices"])
        acc.append(float(np.argmax([w[0] for w in want[k: k + n]]) == s["doc"]["answer"]))
        k += n
    assert res["results"]["dflash2_mc"]["acc,none"] == pytest.approx(np.mean(acc))
    plant.append(True)  # logprobs read one row off: the comparison catches it
    shifted = [r[0][0] for s in evaluate()["samples"]["dflash2_mc"] for r in s["resps"]]
    assert np.abs(np.array(shifted) - [w[0] for w in want]).max() > 0.5
