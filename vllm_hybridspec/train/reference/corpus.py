"""The code corpus: the ``.py`` files of the running interpreter's standard library, split into
train / held-out by file.

The split is a function of each file's path relative to the stdlib root (SHA-256 of the path), so
the same file lands on the same side on every machine; the stdlib itself differs between Python
versions, which is why :func:`build_split` records the Python version, every file with its size and
content hash, and one hash over the whole list (``corpus_hash``). ``split.json`` written next to the
models is what makes two rebuilds comparable: :func:`load_split` reads it back and reports files that
are missing or changed on this machine.
"""

from __future__ import annotations

import hashlib
import json
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

# Test suites are excluded: they are mostly data fixtures, generated tables and deliberately odd code.
EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[str]:
    """Relative POSIX paths of the corpus files under ``root`` (default: the stdlib), sorted."""
    root = Path(root) if root is not None else stdlib_root()
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if EXCLUDED_DIRS.isdisjoint(rel.parts[:-1]) and path.is_file():
            files.append(rel.as_posix())
    return sorted(files)


def is_heldout(rel_path: str, heldout_percent: int) -> bool:
    """Held-out iff the first 8 hex digits of ``sha256(rel_path)`` fall in the lowest ``heldout_percent``."""
    return int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16) % 100 < heldout_percent


@dataclass
class Split:
    root: Path
    train: list[str]
    heldout: list[str]
    meta: dict

    def texts(self, which: str) -> list[str]:
        """File contents of ``which`` (``"train"`` or ``"heldout"``), in split order."""
        if which not in ("train", "heldout"):
            raise ValueError(f"which={which!r}; expected 'train' or 'heldout'")
        return [read_source(self.root / f) for f in getattr(self, which)]


def read_source(path: Path) -> str:
    # a few stdlib files are not UTF-8 (e.g. test data in other codecs); keep them byte-faithful
    return path.read_bytes().decode("utf-8", errors="replace")


def _file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def build_split(root: Path | None = None, heldout_percent: int = 5) -> Split:
    """The file-level split of the corpus under ``root`` (default: this interpreter's stdlib)."""
    if not 0 < heldout_percent < 100:
        raise ValueError(f"heldout_percent={heldout_percent}; expected an integer in 1..99")
    root = Path(root) if root is not None else stdlib_root()
    files = stdlib_files(root)
    if not files:
        raise ValueError(f"no .py files under {root}; is this a Python standard library directory?")
    digests = {f: _file_digest(root / f) for f in files}
    heldout = [f for f in files if is_heldout(f, heldout_percent)]
    train = [f for f in files if not is_heldout(f, heldout_percent)]
    listing = "\n".join(f"{f} {digests[f]}" for f in files)
    meta = {
        "python_version": platform.python_version(),
        "stdlib_root": str(root),
        "heldout_percent": heldout_percent,
        "excluded_dirs": sorted(EXCLUDED_DIRS),
        "num_files": len(files),
        "num_train": len(train),
        "num_heldout": len(heldout),
        "train_bytes": sum((root / f).stat().st_size for f in train),
        "heldout_bytes": sum((root / f).stat().st_size for f in heldout),
        "corpus_hash": hashlib.sha256(listing.encode()).hexdigest(),
        "file_digests": digests,
    }
    return Split(root, train, heldout, meta)


def save_split(split: Split, path: str | Path) -> None:
    data = {**split.meta, "train": split.train, "heldout": split.heldout}
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def load_split(path: str | Path, root: Path | None = None) -> tuple[Split, list[str]]:
    """A recorded split, resolved against ``root`` (default: this stdlib). Returns the split restricted
    to files present and unchanged here, and the list of files that are missing or differ."""
    data = json.loads(Path(path).read_text())
    root = Path(root) if root is not None else stdlib_root()
    digests = data["file_digests"]
    bad = [
        f
        for f in data["train"] + data["heldout"]
        if not (root / f).is_file() or _file_digest(root / f) != digests[f]
    ]
    skip = set(bad)
    meta = {k: v for k, v in data.items() if k not in ("train", "heldout")}
    split = Split(
        root,
        [f for f in data["train"] if f not in skip],
        [f for f in data["heldout"] if f not in skip],
        meta,
    )
    return split, bad
