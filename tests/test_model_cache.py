"""The model cache's publication (qurl_mcore.models.publish): one rename, races between makers of the same
entry are harmless, a refresh replaces."""
import multiprocessing
import os

from qurl_mcore.models import publish


def _entry(root, tag):
    tmp = root / f".tmp-{tag}"
    tmp.mkdir()
    (tmp / "config.json").write_text(tag)
    return tmp


def test_the_first_maker_wins_and_the_later_copy_is_dropped(tmp_path):
    out = tmp_path / "tiny-x"
    assert publish(_entry(tmp_path, "a"), out) == out
    assert publish(_entry(tmp_path, "b"), out) == out
    assert (out / "config.json").read_text() == "a"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-x"]  # no temporary directory left behind


def test_a_refresh_replaces_the_entry_and_leaves_nothing_else(tmp_path):
    out = tmp_path / "tiny-x"
    publish(_entry(tmp_path, "a"), out)
    publish(_entry(tmp_path, "b"), out, replace=True)
    assert (out / "config.json").read_text() == "b"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-x"]


def _make(root, tag, start):
    start.wait()
    publish(_entry(root, tag), root / "tiny-x")


def test_concurrent_makers_all_succeed_with_one_complete_entry(tmp_path):
    start = multiprocessing.get_context("fork").Barrier(4)
    procs = [multiprocessing.get_context("fork").Process(target=_make, args=(tmp_path, str(i), start))
             for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert (tmp_path / "tiny-x" / "config.json").read_text() in {"0", "1", "2", "3"}
    assert os.listdir(tmp_path) == ["tiny-x"]
