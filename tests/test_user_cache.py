"""Where the per-user cache lives (LINESIDE_CACHE_DIR, an absolute XDG_CACHE_HOME, ~/.cache), and that a folder
anyone can write to is never used: what is kept there is trusted once its key and seal match."""

from __future__ import annotations

from pathlib import Path

from lineside import user_cache


def test_root_follows_the_env_var_then_xdg_then_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(user_cache.ENV_DIR, str(tmp_path / "mine"))
    assert user_cache.root() == tmp_path / "mine"
    monkeypatch.delenv(user_cache.ENV_DIR)
    assert user_cache.root() == tmp_path / "xdg" / "lineside"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec: ignored unless absolute
    assert user_cache.root() == tmp_path / "home" / ".cache" / "lineside"


def test_folders_are_made_for_the_user_alone(tmp_path, monkeypatch):
    monkeypatch.setenv(user_cache.ENV_DIR, str(tmp_path / "c"))
    assert user_cache.folder("ort", make=False) is None and not (tmp_path / "c").exists()
    made = user_cache.folder("ort")
    assert made == tmp_path / "c" / "ort" and made.stat().st_mode & 0o077 == 0


def test_a_folder_every_user_can_write_is_not_used(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(user_cache.ENV_DIR, str(tmp_path / "c"))
    (tmp_path / "c" / "verified").mkdir(parents=True)
    (tmp_path / "c" / "verified").chmod(0o777)
    with caplog.at_level("WARNING"):
        assert user_cache.folder("verified", make=False) is None
        assert user_cache.folder("verified") is None
    [line] = [r.getMessage() for r in caplog.records]
    assert "writable by every user" in line and "chmod o-w" in line and user_cache.ENV_DIR in line


def test_a_path_that_is_no_folder_is_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv(user_cache.ENV_DIR, str(tmp_path / "c"))
    Path(tmp_path / "c").write_text("a file")
    with caplog.at_level("WARNING"):
        assert user_cache.folder("ort") is None
    assert len(caplog.records) == 1 and str(tmp_path / "c" / "ort") in caplog.records[0].getMessage()
