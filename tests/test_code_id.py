"""bench/code_id.py: the digest that names the attn-otel code a benchmark measured.  The same digest from an
installed copy, a working tree and ``git ls-tree`` at the commit; another one after any change to a file; and
``--find`` names the commits that have it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import code_id  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    r = tmp_path / "repo"
    (r / "attn_otel" / "sub").mkdir(parents=True)
    (r / "exporters").mkdir()
    (r / "attn_otel" / "__init__.py").write_text("X = 1\n")
    (r / "attn_otel" / "sub" / "deep.py").write_text("Y = 2\n")
    (r / "attn_otel" / "page.html").write_text("<p>not code</p>\n")
    (r / "exporters" / "otel.py").write_text("Z = 3\n")
    (r / "bench.py").write_text("outside the package\n")
    _git(r, "init", "-q")
    _git(r, "-c", "user.email=t@t", "-c", "user.name=t", "add", "-A")
    _git(r, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    return r


def _installed(repo: Path, dest: Path) -> Path:
    """The package as a wheel lays it out: exporters/ inside it, no data files needed."""
    pkg = dest / "attn_otel"
    shutil.copytree(repo / "attn_otel", pkg)
    shutil.copytree(repo / "exporters", pkg / "exporters")
    return pkg


def test_installed_checkout_and_commit_give_one_digest(repo, tmp_path):
    d = code_id.digest_at("HEAD", repo)
    assert code_id.digest_checkout(repo) == d
    pkg = _installed(repo, tmp_path / "site")
    assert code_id.digest_dir(pkg) == d == code_id.digest_package(pkg)
    assert code_id.digest_package(repo / "attn_otel") == d  # an editable install points into the checkout
    (repo / "attn_otel" / "page.html").write_text("<p>changed, still not code</p>\n")
    (repo / "bench.py").write_text("changed, outside\n")
    assert code_id.digest_checkout(repo) == d


@pytest.mark.parametrize("change", ["edit", "exporter", "new file", "rename"])
def test_any_change_to_the_code_changes_the_digest(repo, tmp_path, change):
    before = code_id.digest_checkout(repo)
    if change == "edit":
        (repo / "attn_otel" / "sub" / "deep.py").write_text("Y = 3\n")
    elif change == "exporter":
        (repo / "exporters" / "otel.py").write_text("Z = 4\n")
    elif change == "new file":
        (repo / "attn_otel" / "extra.py").write_text("")
    else:
        (repo / "attn_otel" / "sub" / "deep.py").rename(repo / "attn_otel" / "deep.py")
    assert code_id.digest_checkout(repo) != before


def test_find_names_the_commits_with_the_digest(repo):
    first = _git(repo, "rev-parse", "HEAD")
    (repo / "attn_otel" / "__init__.py").write_text("X = 2\n")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "two")
    second = _git(repo, "rev-parse", "HEAD")
    (repo / "bench.py").write_text("only outside the package\n")
    _git(repo, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qam", "three")
    third = _git(repo, "rev-parse", "HEAD")
    assert code_id.find(code_id.digest_at(first, repo), repo) == [first[:12]]
    assert code_id.find(code_id.digest_checkout(repo), repo) == [third[:12], second[:12]]
    assert code_id.find("000000000000", repo) == []
    assert code_id.main(["--repo", str(repo), "--find", "000000000000"]) == 1


def test_this_checkouts_installed_package_is_found():
    """The test environment's attn_otel (the .venv's install of this checkout) has a digest, as the benchmark's
    phase files record it."""
    d = code_id.digest_installed()
    assert d is not None and len(d) == 12
