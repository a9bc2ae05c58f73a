"""Which attn-otel code a benchmark measured, from the package it imported (the device machine's checkout has no
reliable git: run 51's reported the session's first commit, not the one its files were).

The digest is over the package's ``.py`` files as installed: each file's git blob id (``git hash-object``) with its
path inside the package, sorted.  The repository's ``exporters/`` is the subpackage ``attn_otel.exporters``
(pyproject.toml), so a checkout's or a commit's files are taken in that layout: the same digest comes from an
installed copy (site-packages/attn_otel), from a working tree, or from ``git ls-tree`` at any commit without
reading a file there.

    python3 bench/code_id.py                       # the digest of this checkout's files as they are on disk
    python3 bench/code_id.py --rev 66c57a4          # the digest at a commit
    python3 bench/code_id.py --find 3f2a9c01d4e5    # the commits (newest first, of the last 500) with that digest
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

PACKAGE = "attn_otel"
SOURCES = {"attn_otel": "", "exporters": "exporters/"}  # checkout folder -> its path inside the installed package


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _digest(pairs: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for path, blob in sorted(pairs):
        h.update(f"{path} {blob}\n".encode())
    return h.hexdigest()[:12]


def _pairs(root: Path, prefix: str = "") -> list[tuple[str, str]]:
    files = sorted(p for p in Path(root).rglob("*.py") if "__pycache__" not in p.parts)
    return [(prefix + p.relative_to(root).as_posix(), _blob_id(p.read_bytes())) for p in files]


def digest_dir(root: Path) -> str:
    """The digest of an installed package directory ``root`` (its ``.py`` files, subpackages included)."""
    pairs = _pairs(root)
    if not pairs:
        raise FileNotFoundError(f"no .py files under {root}")
    return _digest(pairs)


def digest_checkout(repo: Path) -> str:
    """The digest of a checkout's files as they are on disk, in the installed layout."""
    pairs = [pair for folder, prefix in SOURCES.items() for pair in _pairs(Path(repo) / folder, prefix)]
    if not pairs:
        raise FileNotFoundError(f"no {PACKAGE}/*.py under {repo}")
    return _digest(pairs)


def digest_installed() -> str | None:
    """The digest of the attn_otel this interpreter imports (found, not imported), None where there is none.  An
    editable install points into a checkout (no ``exporters/`` inside the package): that checkout's digest."""
    spec = find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    return digest_package(Path(list(spec.submodule_search_locations)[0]))


def digest_package(root: Path) -> str:
    """The digest of the attn_otel package directory ``root``, installed or a checkout's."""
    root = Path(root)
    if not (root / "exporters").is_dir() and (root.parent / "exporters").is_dir():
        return digest_checkout(root.parent)
    return digest_dir(root)


def digest_at(rev: str, repo: Path = Path(".")) -> str:
    """The digest of the package at commit ``rev`` of the git checkout ``repo`` (one ``git ls-tree``)."""
    out = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", rev, "--", *(f + "/" for f in SOURCES)],
                         capture_output=True, text=True, check=True).stdout
    pairs = []
    for line in out.splitlines():
        meta, _, path = line.partition("\t")
        folder, _, rel = path.partition("/")
        if rel.endswith(".py") and "__pycache__" not in rel:
            pairs.append((SOURCES[folder] + rel, meta.split()[2]))
    if not pairs:
        raise FileNotFoundError(f"no {PACKAGE}/*.py at {rev}")
    return _digest(pairs)


def find(digest: str, repo: Path = Path("."), last: int = 500) -> list[str]:
    """The commits among the ``last`` reachable from HEAD (newest first) whose package has ``digest``."""
    revs = subprocess.run(["git", "-C", str(repo), "rev-list", f"--max-count={last}", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for rev in revs:
        try:
            if digest_at(rev, repo) == digest:
                hits.append(rev[:12])
        except FileNotFoundError:
            continue
    return hits


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", help="a commit: its package's digest")
    ap.add_argument("--find", metavar="DIGEST", help="the commits whose package has this digest")
    ap.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--last", type=int, default=500, help="with --find: how many commits back to look")
    args = ap.parse_args(argv)
    if args.find:
        hits = find(args.find, args.repo, args.last)
        print("\n".join(hits) if hits else f"no commit among the last {args.last} has {args.find}")
        return 0 if hits else 1
    print(digest_at(args.rev, args.repo) if args.rev else digest_checkout(args.repo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
