"""Oracle top-K τ (docs/design.md): τ if the selector always picked the target's token whenever it is among the K
candidates — the ceiling the selector can reach. Measured with extra target passes, which the decoder
excludes from its timing.

At T > 0 the oracle continuation is defined the same way as at T = 0: after the committed prefix (the
accepted drafts and the bonus token, which at T > 0 is a sample), the rows' oracle tokens are the target's
argmax continuation. It is a ceiling for greedy verification; at T > 0 it is a diagnostic of how often the
target's most likely token is among the candidates, not an acceptance bound.
"""

from __future__ import annotations

import numpy as np

from dflash2_trt.runtime.protocol import TargetRunner


def oracle_count(target: TargetRunner, cand: np.ndarray, drafts: list[int], n_rows: int, accepted: int, bonus: int,
                 pos: int) -> int:
    """Oracle top-K count of one cycle: leading rows whose target continuation is among the row's candidates
    ``cand`` [L, K]. The continuation is the committed prefix (accepted drafts + bonus) followed by the
    target's argmax tokens, obtained with extra passes of ``target`` at the positions after the committed
    prefix; the cache is cropped back after each pass.
    """
    known = list(drafts[:accepted]) + [bonus]  # known[i]: target token for draft row i
    base = pos + accepted + 1  # cache length after commit: positions <= pos + accepted
    o = 0
    while o < n_rows:
        if o == len(known):
            fed = known[accepted:] + drafts[len(known):n_rows]  # positions base.. ; filler = drafts
            logits, _ = target.forward(fed)
            target.crop(base)
            am = np.asarray(logits).argmax(-1).tolist()
            j = len(known) - accepted - 1  # fed index whose logits predict row len(known)
            known.append(am[j])
            while len(known) < n_rows and j + 1 < len(fed) and fed[j + 1] == known[-1]:
                j += 1
                known.append(am[j])
        if known[o] not in cand[o].tolist():
            break
        o += 1
    return o
