"""A result names the code it ran: the commit, whether the package differs from it, and a digest
of the package's sources that holds where the tree carries no (or an older) git history."""
from veloxquant_mlx.bench import report


def test_machine_info_names_the_code():
    info = report.machine_info()
    assert len(info["source_digest"]) == 12 and int(info["source_digest"], 16) >= 0
    assert info["package_changed_since_commit"] in (True, False, None)
    assert report.source_digest() == info["source_digest"]


def test_the_digest_follows_the_sources_content_and_names(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not code")
    first = report.source_digest(tmp_path)
    (tmp_path / "notes.txt").write_text("changed, still not code")
    assert report.source_digest(tmp_path) == first
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    changed = report.source_digest(tmp_path)
    assert changed != first
    (tmp_path / "sub" / "b.py").rename(tmp_path / "sub" / "c.py")
    assert report.source_digest(tmp_path) not in (first, changed)
