"""Publishing a finished output over an older one: the name moves at once, the old data is let
go of on a thread of its own, and nothing is left beside it."""

from __future__ import annotations

import os
import threading

import pytest

from mgpu import paths


def _join_releases() -> None:
    for t in threading.enumerate():
        if t.name == paths.REPLACED_THREAD:
            t.join()


def test_a_file_is_replaced_in_one_rename_and_its_old_pages_are_let_go_of_elsewhere(tmp_path, monkeypatch):
    path, partial = tmp_path / "c.npy", tmp_path / ".c.npy.1.partial"
    path.write_bytes(b"old")
    partial.write_bytes(b"new")
    renames, closes = [], []
    real_replace, real_close = os.replace, os.close
    monkeypatch.setattr(os, "replace", lambda a, b: (renames.append((str(a), str(b))), real_replace(a, b))[1])
    monkeypatch.setattr(os, "close", lambda fd: (closes.append(threading.current_thread().name), real_close(fd))[1])
    paths.publish(str(partial), str(path))
    _join_releases()
    monkeypatch.undo()
    assert path.read_bytes() == b"new" and [p.name for p in tmp_path.iterdir()] == ["c.npy"]
    assert renames == [(str(partial), str(path))]  # never a moment without a file under the name
    assert closes == [paths.REPLACED_THREAD]  # the last hold on the old file, dropped off the caller's thread


def test_a_store_moves_the_old_one_aside_and_removes_it_elsewhere(tmp_path, monkeypatch):
    path, partial = tmp_path / "c.zarr", tmp_path / ".c.zarr.1.partial"
    (path / "0").mkdir(parents=True)
    (partial / "1").mkdir(parents=True)
    removed_on = []
    real_remove = paths.remove
    monkeypatch.setattr(
        paths, "remove", lambda p: (removed_on.append(threading.current_thread().name), real_remove(p))[1]
    )
    paths.publish(str(partial), str(path))
    _join_releases()
    assert [p.name for p in path.iterdir()] == ["1"] and [p.name for p in tmp_path.iterdir()] == ["c.zarr"]
    assert removed_on == [paths.REPLACED_THREAD]


def test_a_failed_publish_keeps_what_was_there(tmp_path, monkeypatch):
    path, partial = tmp_path / "c.zarr", tmp_path / ".c.zarr.1.partial"
    (path / "0").mkdir(parents=True)
    (partial / "1").mkdir(parents=True)
    real_replace = os.replace

    def replace(a: str, b: str) -> None:
        if str(a) == str(partial):
            raise OSError(28, "No space left on device")
        real_replace(a, b)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        paths.publish(str(partial), str(path))
    monkeypatch.undo()
    _join_releases()
    assert [p.name for p in path.iterdir()] == ["0"]  # the older store is back under its name
    file = tmp_path / "c.npy"
    file.write_bytes(b"old")
    with pytest.raises(FileNotFoundError):  # the finished file vanished
        paths.publish(str(tmp_path / "missing.partial"), str(file))
    assert file.read_bytes() == b"old"
