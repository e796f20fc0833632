"""Folders the commands write, and the one rule for replacing them: never delete what we did not write.

Every command that writes a folder builds it in a hidden temporary sibling ``.NAME.KIND-XXXXXXXX`` and moves it
into place whole (the folder is never partial). An existing folder is replaced only when it proves to be ours:

* an export (``dflash2 export --out``): its ``manifest.json`` parses as ours (:func:`read_manifest`) and lists
  every file in the folder;
* a Triton repository (``--triton-repo``, ``dflash2 triton-repo``): its ``dflash2-repo.json`` lists every file.

Files that the record does not list (user files), and TensorRT engines built into an export since
(``build-engines``), are removed only with ``--overwrite``, which names them first on stderr. A non-empty folder
that is not ours, or a path that is not a folder, is refused with one line — ``--overwrite`` does not change
that. Commands that add to a folder in place (``make-data``, ``train``, ``make-tiny``) check their own folders
with :func:`check_entries`.

Published folders are world-readable like any build output: files 0644, folders 0755, set explicitly (not from
the umask), so that a server running as another user (Triton) can read them.

Temporaries of an interrupted run (kill -9) are removed on the next write of the same folder, with a line on
stderr: those older than this process and not locked. A live writer holds an exclusive ``flock`` on its
temporary folder for its whole life (the lock follows the folder's inode through renames and ends with the
process, however it ends).
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from dflash2_trt.errors import DFlash2Error

PROCESS_START = time.time()  # temporaries modified after this may belong to a writer that started after us
FILE_MODE, DIR_MODE = 0o644, 0o755
TEMP_KINDS = ("export", "triton", "old")  # .NAME.KIND-XXXXXXXX siblings this module makes
REPO_RECORD = "dflash2-repo.json"  # a Triton repository's list of the files we wrote (Triton reads folders only)
REPO_FORMAT = "dflash2-trt-triton-repo"
_SHOWN = 5  # file names quoted in a message


def _say(msg: str) -> None:
    print(f"dflash2: {msg}", file=sys.stderr)


def _quote(names: Iterable[str]) -> str:
    names = sorted(names)
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def entries(folder: Path) -> set[str]:
    """Every file, link and empty folder under ``folder`` (relative POSIX paths; empty folders end in '/')."""
    out: set[str] = set()
    for p in folder.rglob("*"):
        rel = p.relative_to(folder).as_posix()
        if p.is_symlink() or p.is_file():
            out.add(rel)
        elif p.is_dir() and not any(p.iterdir()):
            out.add(rel + "/")
    return out


# -- ownership ----------------------------------------------------------------------------------------------
# An owner check reads a folder's record: -> (files the writer may replace freely, files replaced only with
# --overwrite and what they are), or raises DFlash2Error with the reason the folder is not ours.
Owner = Callable[[Path], tuple[set[str], dict[str, str]]]


def export_owner(folder: Path) -> tuple[set[str], dict[str, str]]:
    """A dflash2 export: manifest.json + the files it lists; engines built since need --overwrite."""
    from dflash2_trt.manifest import MANIFEST_FILE, read_manifest

    m = read_manifest(folder, verify_checksums=False)
    eng = f"{m.engines.dir}/" if m.engines is not None else None
    later = {f: "TensorRT engines from build-engines" for f in m.files if eng and f.startswith(eng)}
    return {MANIFEST_FILE, *(f for f in m.files if f not in later)}, later


def repo_owner(folder: Path) -> tuple[set[str], dict[str, str]]:
    """A Triton repository we wrote: dflash2-repo.json + the files it lists."""
    rec = folder / REPO_RECORD
    if not rec.is_file():
        raise DFlash2Error(f"it has no {REPO_RECORD}")
    try:
        data = json.loads(rec.read_text())
    except (OSError, ValueError) as e:
        raise DFlash2Error(f"{REPO_RECORD} is unreadable: {e}") from None
    files = data.get("files") if isinstance(data, dict) and data.get("format") == REPO_FORMAT else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        raise DFlash2Error(f"{REPO_RECORD} is not a {REPO_FORMAT} record")
    return {REPO_RECORD, *files}, {}


def write_repo_record(folder: Path) -> None:
    """Record every file now in ``folder`` (a Triton repository being built) as ours."""
    files = sorted(entries(folder))
    (folder / REPO_RECORD).write_text(json.dumps({"format": REPO_FORMAT, "version": 1, "files": files}, indent=1)
                                      + "\n")


def check_replace(out: Path, flag: str, owner: Owner, overwrite: bool = False) -> None:
    """Raise DFlash2Error (one line) unless ``out`` is absent, an empty folder, or a folder ``owner`` proves ours
    whose every entry it lists (or, with ``overwrite``, whose extra entries it names on stderr first)."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise DFlash2Error(f"{flag} {out} exists and is not a folder; refusing to replace it")
    if not out.exists() or not any(out.iterdir()):
        return
    try:
        free, later = owner(out)
    except DFlash2Error as e:
        raise DFlash2Error(f"{flag} {out} is a non-empty folder that dflash2 did not write ({e}); refusing to "
                           f"replace it: choose another {flag}, or remove it yourself") from None
    have = entries(out)
    extra = {f: later.get(f, "not written by dflash2") for f in have - free}
    if not extra:
        return
    kinds = sorted(set(extra.values()))
    what = f"{len(extra)} file(s) ({'; '.join(kinds)}): {_quote(extra)}"
    if not overwrite:
        raise DFlash2Error(f"{flag} {out} holds {what} that its record does not list; pass --overwrite to replace "
                           f"the folder and remove them, or choose another {flag}")
    _say(f"--overwrite: replacing {out} removes {what}")


def check_entries(out: Path, flag: str, allowed: Callable[[str], bool], what: str) -> None:
    """For commands that add to a folder in place: ``out`` is absent, empty, or every top-level entry is one that
    the command writes (``allowed(name)``); else one line."""
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise DFlash2Error(f"{flag} {out} exists and is not a folder")
    if not out.is_dir():
        return
    foreign = [p.name for p in out.iterdir() if not allowed(p.name)]
    if foreign:
        raise DFlash2Error(f"{flag} {out} holds files that are not {what} ({_quote(foreign)}); refusing to write "
                           f"into it: choose another {flag}")


# -- temporaries --------------------------------------------------------------------------------------------
def _temp_re(name: str) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(name)}\.({'|'.join(TEMP_KINDS)})-[A-Za-z0-9_]+$")


def _try_lock(path: Path) -> int | None:
    """An fd holding an exclusive flock on the folder ``path``, or None when another process holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def clean_stale(out: Path) -> list[Path]:
    """Remove the temporaries of interrupted writes of ``out`` (older than this process, not locked); say so."""
    return _clean(out.parent, _temp_re(out.name))


ENGINES_TEMP = re.compile(r"^\.engines-[0-9a-f]{8}\.tmp$")  # build-engines' folder inside an export


def clean_stale_engines(export_dir: Path) -> list[Path]:
    """The same for the engine folders an interrupted ``build-engines`` left inside ``export_dir``."""
    return _clean(export_dir, ENGINES_TEMP)


def _clean(folder: Path, pat: re.Pattern) -> list[Path]:
    removed: list[Path] = []
    if not folder.is_dir():
        return removed
    for p in sorted(folder.iterdir()):
        if not pat.match(p.name) or p.is_symlink() or not p.is_dir():
            continue
        try:
            if p.stat().st_mtime >= PROCESS_START:
                continue
            fd = _try_lock(p)
        except OSError:
            continue
        if fd is None:  # a live writer
            continue
        try:
            shutil.rmtree(p, ignore_errors=True)
        finally:
            os.close(fd)
        if not p.exists():
            removed.append(p)
            _say(f"removed {p}: a temporary folder left by an interrupted run")
    return removed


def lock_folder(path: Path) -> int | None:
    """Hold an exclusive flock on the folder ``path`` (until the returned fd is closed or the process ends), so
    that :func:`clean_stale` leaves it alone; None when another process holds it."""
    return _try_lock(path)


class TempFolder:
    """``with TempFolder(out, "export") as t:`` ``t.path``, a locked hidden sibling of ``out`` to build in; stale
    temporaries of ``out`` are cleaned first; ``t.path`` is removed on leaving unless :meth:`publish` moved it."""

    def __init__(self, out: Path, kind: str) -> None:
        assert kind in TEMP_KINDS
        self.out, self.kind = Path(out), kind
        self.path: Path | None = None
        self._fd: int | None = None

    def __enter__(self) -> TempFolder:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        clean_stale(self.out)
        self.path = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.{self.kind}-", dir=self.out.parent))
        self._fd = _try_lock(self.path)
        return self

    def publish(self) -> None:
        """Make the finished temporary folder ``out``: modes set, a previous ``out`` renamed aside (locked),
        the new one renamed in, the old one removed — ``out`` is never partial."""
        assert self.path is not None
        make_world_readable(self.path)
        if self.out.exists():
            old = self.out.with_name(f".{self.out.name}.old-{self.path.name[-8:]}")
            fd = _try_lock(self.out)
            try:
                self.out.rename(old)
                self.path.rename(self.out)
                shutil.rmtree(old, ignore_errors=True)
            finally:
                if fd is not None:
                    os.close(fd)
        else:
            self.path.rename(self.out)
        self.path = None

    def __exit__(self, *exc: object) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)


def make_world_readable(root: Path) -> None:
    """Folders 0755, files 0644 under ``root`` (and ``root`` itself); links are left alone."""
    os.chmod(root, DIR_MODE)
    for d, dirs, files in os.walk(root):
        for n in dirs:
            if not os.path.islink(os.path.join(d, n)):
                os.chmod(os.path.join(d, n), DIR_MODE)
        for n in files:
            if not os.path.islink(os.path.join(d, n)):
                os.chmod(os.path.join(d, n), FILE_MODE)


def write_error(e: OSError, out: Path) -> DFlash2Error:
    """The one line for an OSError while writing ``out`` (disk full first: the common one)."""
    if e.errno == errno.ENOSPC:
        return DFlash2Error(f"no space left on the device while writing {out}; nothing was written (free space "
                            f"and run again)")
    where = f" ({e.filename})" if e.filename else ""
    return DFlash2Error(f"cannot write {out}: {e.strerror or e}{where}; nothing was written")
