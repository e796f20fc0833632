"""Structured outputs under speculation (dflash2_trt/runtime/grammar.py): the grammar checked once, the draft's
candidates masked along the path, the verify rows masked, the matcher rolled back to the accepted length.

On the demo export (SmolLM2-135M-Instruct + its drafter): a json_schema answer validates and equals plain
constrained decoding (``speculative=False``) token for token, in the single loop and the batched loop; the cycles
really ran constrained (constrain_draft and commit called, partial acceptances among them). Negative control: a
commit that does not roll the matcher back after a partial acceptance is caught. The T > 0 draft law: a refused
draft redrawn from the renormalised proposal leaves each row distributed as the masked q (chi-square).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("llguidance")

import dflash2_trt  # noqa: E402
from dflash2_trt.errors import DFlash2Error  # noqa: E402
from dflash2_trt.runtime import grammar  # noqa: E402
from dflash2_trt.runtime.grammar import GrammarSpec  # noqa: E402
from dflash2_trt.runtime.protocol import Draft  # noqa: E402
from dflash2_trt.runtime.request import GenerationRequest  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "field": {"type": "string", "enum": ["physics", "chemistry", "biology"]},
                                           "born": {"type": "integer"}},
          "required": ["name", "field", "born"], "additionalProperties": False}
PROMPTS = ["Give me a JSON object with the name, field and birth year of a famous scientist.",
           "Describe Marie Curie as JSON."]


@pytest.mark.parametrize("kind,text", [("yaml", "x"), ("json_schema", "{not json"), ("json_schema", "[1]"),
                                       ("regex", ""), ("regex", "(unclosed"), ("lark", "start: undefined_rule")])
def test_bad_grammars_are_refused_when_built(kind, text):
    with pytest.raises(DFlash2Error):
        GrammarSpec(kind, text)
    with pytest.raises(DFlash2Error, match="GrammarSpec"):
        GenerationRequest(grammar={"type": "object"})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gen():
    from dflash2_trt.bench.exports import demo_export

    with dflash2_trt.load(demo_export(), "ort", threads=1) as g:
        yield g


def _request(spec: bool, **kw) -> GenerationRequest:
    return GenerationRequest(max_new_tokens=40, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)),
                             speculative=spec, seed=0, guard=False, proposer="dflash2", **kw)


def _counting(monkeypatch) -> dict:
    """Counts of the grammar steps the loops take (constrain_draft, commit, partial acceptances)."""
    seen = {"constrain": 0, "commit": 0, "partial": 0}
    real_constrain, real_commit = grammar.constrain_draft, grammar.commit

    def constrain(*a, **k):
        seen["constrain"] += 1
        return real_constrain(*a, **k)

    def commit(c, n, acc, bonus):
        seen["commit"] += 1
        seen["partial"] += acc < n
        return real_commit(c, n, acc, bonus)

    monkeypatch.setattr(grammar, "constrain_draft", constrain)
    monkeypatch.setattr(grammar, "commit", commit)
    return seen


def test_json_schema_greedy_speculative_equals_plain_and_validates(gen, monkeypatch):
    jsonschema = pytest.importorskip("jsonschema")
    seen = _counting(monkeypatch)
    for p in PROMPTS:
        msgs = [{"role": "user", "content": p}]
        plain = gen.generate(msgs, request=_request(False))
        spec = gen.generate(msgs, request=_request(True))
        assert spec.tokens == plain.tokens, p
        jsonschema.validate(json.loads(spec.text), SCHEMA)
        assert spec.finish_reason == "stop"
        batched = gen.submit(msgs, request=_request(True)).result()
        assert batched.tokens == plain.tokens
    assert seen["constrain"] > 0 and seen["commit"] == seen["constrain"], seen
    assert seen["partial"] > 0, seen  # rollbacks of rejected drafts happened


def test_a_matcher_not_rolled_back_is_caught(gen, monkeypatch):
    """A regex of bounded length (each extra token the matcher keeps uses up its budget): speculative = plain;
    negative control: commit without the rollback (the matcher keeps the rejected drafts) is caught."""
    msgs = [{"role": "user", "content": "Describe the sky on a summer evening."}]
    regex = GrammarSpec("regex", "[A-Za-z ,]{10,80}\\.")

    def run(spec: bool) -> list[int]:
        return gen.generate(msgs, request=GenerationRequest(max_new_tokens=40, grammar=regex, speculative=spec,
                                                            seed=0, guard=False, proposer="dflash2")).tokens

    plain = run(False)
    seen = _counting(monkeypatch)
    assert run(True) == plain
    assert seen["partial"] > 0, seen

    def no_rollback(c, n, acc, bonus):
        c.consume([bonus])

    monkeypatch.setattr(grammar, "commit", no_rollback)
    try:
        out = run(True)
    except DFlash2Error:
        return
    assert out != plain


class _Allowed:
    """A stand-in matcher allowing a fixed token set in every state (constrain_draft's side of the law)."""

    def __init__(self, V: int, allowed: list[int]) -> None:
        self.V, self.allowed = V, np.zeros(V, bool)
        self.allowed[allowed] = True
        self.eos = np.asarray([V - 1])
        self.consumed: list[int] = []

    def mask(self) -> np.ndarray:
        return self.allowed.copy()

    def consume(self, tokens: list[int]) -> None:
        self.consumed += tokens


def test_redrawn_draft_is_distributed_as_the_masked_proposal():
    from scipy.stats import chisquare

    rng = np.random.default_rng(0)
    V, K = 12, 5
    cand = np.array([[3, 7, 1, 9, 4]])  # [1, K]
    q = np.array([[0.4, 0.25, 0.15, 0.12, 0.08]], np.float32)  # [1, K]: 3 and 9 refused below
    allowed = [7, 1, 4]
    counts = {t: 0 for t in allowed}
    n = 20000
    for _ in range(n):
        d = int(cand[0, rng.choice(K, p=q[0] / q[0].sum())])  # the drafter's own draw
        m = _Allowed(V, allowed)
        draft = Draft(tokens=np.array([d]), proposal=q, cand=cand)
        new, drafts, masks = grammar.constrain_draft(m, draft, [d], 1.0, rng)
        counts[drafts[0]] += 1
    qm = np.where(np.isin(cand[0], allowed), q[0], 0)
    qm = qm / qm.sum()
    np.testing.assert_allclose(new.proposal[0], qm, rtol=1e-6)  # the proposal fed to rejection sampling
    qm = qm.astype(np.float64) / qm.astype(np.float64).sum()
    exp = [qm[list(cand[0]).index(t)] * n for t in allowed]
    assert chisquare([counts[t] for t in allowed], exp)[1] > 1e-3
    assert masks.shape == (2, V) and not masks[0][3]
    # greedy: the refused top draft becomes the best-ranked allowed candidate
    new, drafts, _ = grammar.constrain_draft(_Allowed(V, allowed), Draft(tokens=np.array([3]), proposal=q,
                                                                          cand=cand), [3], 0.0, rng)
    assert drafts == [7]
    # no allowed candidate: the path is cut there
    new, drafts, masks = grammar.constrain_draft(_Allowed(V, [0, 2]), Draft(tokens=np.array([3]), proposal=q,
                                                                             cand=cand), [3], 0.0, rng)
    assert drafts == [] and masks.shape == (1, V)
    # one token allowed (the grammar forces it): it is the draft, with a one-hot proposal, at T = 0 and T > 0
    for T in (0.0, 1.0):
        new, drafts, _ = grammar.constrain_draft(_Allowed(V, [0]), Draft(tokens=np.array([3]), proposal=q,
                                                                          cand=cand), [3], T, rng)
        assert drafts == [0] and new.cand[0, -1] == 0 and list(new.proposal[0]) == [0, 0, 0, 0, 1]
