"""Checks of user-given values, defined once: argparse ``type=`` functions for the CLIs and :func:`check_size` for
the Python API, so that every bad value is one line ``dflash2: error: argument --FLAG: ...`` (exit 1) before any
work or allocation starts.

    integer(lo, hi)          an int in [lo, hi] (hi None: no upper bound)
    number(lo, hi, lo_open)  a finite float in [lo, hi] ((lo, hi] with lo_open): nan / inf are refused
    BLOCK_SIZE, SEED, COUNT, THREADS, PROBABILITY, POSITIVE_NUMBER: the common ones
    DEVICE                   cpu | cuda | cuda:N (torch's names; availability is checked at run time)
    text(value)              a str argument whose bytes decoded to valid UTF-8 (argv holds surrogate escapes
                             otherwise)

Also :class:`Parser`, the ``ArgumentParser`` every ``dflash2`` subcommand uses: its errors (an unknown flag, a
bad choice, a flag combination, a value refused above) raise :class:`DFlash2Error`, so the CLI prints one line
and exits 1 for every bad input, as for errors found later.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from dflash2_trt.errors import DFlash2Error

#: the block sizes a drafter is exported / trained / evaluated at (block size - 1 draft rows; the selector's
#: lattice and the plugin's shared memory are sized for at most 64 rows)
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 2, 64
MAX_SEED = 2**32 - 1  # every seed consumer takes it (numpy, torch.manual_seed, the C API's uint64)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``error`` raises DFlash2Error (the CLI: one line, exit 1)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise DFlash2Error(f"{message} (see {self.prog} --help)")


def _range_text(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    if hi is None:
        return f"{'>' if lo_open else '>='} {lo}"
    return f"in {'(' if lo_open else '['}{lo}, {hi}]"


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {_range_text(lo, hi)}, got {v}")
        return v

    parse.__name__ = "integer"
    return parse


def number(lo: float | None = None, hi: float | None = None, lo_open: bool = False) -> Callable[[str], float]:
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
        if not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {s}")
        if lo is not None and (v < lo or (lo_open and v == lo)):
            raise argparse.ArgumentTypeError(f"must be {_range_text(lo, hi, lo_open)}, got {v}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be {_range_text(lo, hi, lo_open)}, got {v}")
        return v

    parse.__name__ = "number"
    return parse


def text(s: str) -> str:
    """A text argument: refused when the command line's bytes were not UTF-8 (Python keeps them as lone
    surrogates, which no tokenizer can encode)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError("is not valid UTF-8 text") from None
    return s


BLOCK_SIZE = integer(MIN_BLOCK_SIZE, MAX_BLOCK_SIZE)
SEED = integer(0, MAX_SEED)
COUNT = integer(1)  # a number of things / steps / tokens: at least one
NON_NEGATIVE = integer(0)
THREADS = integer(1, 1024)
PROBABILITY = number(0.0, 1.0)
POSITIVE_NUMBER = number(0.0, lo_open=True)
NON_NEGATIVE_NUMBER = number(0.0)


def device(s: str) -> str:
    """A torch device name: ``cpu``, ``cuda`` or ``cuda:N`` (whether CUDA is there is checked when the command
    runs: parsing imports no torch)."""
    import re

    if re.fullmatch(r"cpu|cuda(:\d+)?", s) is None:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {s!r}")
    return s


DEVICE = device


def check_size(flag: str, value: int | None, lo: int, hi: int) -> None:
    """The API twin of the type functions: ``value`` (None: the default) must be an int in [lo, hi]."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise DFlash2Error(f"{flag} must be in [{lo}, {hi}], got {value!r}")
