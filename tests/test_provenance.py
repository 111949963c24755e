"""`qurl_mcore.provenance`: the commit and dirtiness of a tree, read from a git repository made here."""
import subprocess

from qurl_mcore.provenance import ROOT, CodeVersion, code_version


def _git(root, *args):
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout


def test_commit_and_dirtiness_of_a_tree(tmp_path):
    root = tmp_path / "tree"
    (root / "qurl_mcore").mkdir(parents=True)
    assert code_version(root) == CodeVersion(None, None)  # not a checkout
    _git(root, "init", "-q")
    assert code_version(root) == CodeVersion(None, None)  # a repository with no commit
    (root / "qurl_mcore" / "a.py").write_text("x = 1\n")
    _git(root, "add", ".")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    head = _git(root, "rev-parse", "HEAD").strip()
    assert code_version(root) == CodeVersion(head, False)
    (root / "runs").mkdir()
    (root / "runs" / "metrics.jsonl").write_text("{}\n")  # a run's own output: not code
    assert not code_version(root).dirty
    (root / "qurl_mcore" / "b.py").write_text("y = 2\n")  # a new module the run imports: code
    assert code_version(root).dirty
    (root / "qurl_mcore" / "b.py").unlink()
    (root / "qurl_mcore" / "a.py").write_text("x = 2\n")
    version = code_version(root)
    assert version.dirty and version.label() == head[:10] + "+dirty"
    # the package copied into a directory inside some checkout is not that checkout's code
    assert code_version(root / "qurl_mcore") == CodeVersion(None, None)
    assert "no git commit" in CodeVersion(None, None).label()


def test_this_tree_is_named_by_its_head():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:  # a checkout (an sdist or wheel has none)
        assert code_version().commit == head.stdout.strip()
