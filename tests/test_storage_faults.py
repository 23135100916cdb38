"""Write faults (full disk, quota, read-only, permission, I/O error), the output_dir lock, and
damaged checkpoints and token caches: one message naming the path, the file system and the
key, nothing half-written left behind. In process, no subprocesses (the quick tier)."""

from __future__ import annotations

import errno
import fcntl
import importlib
import json
import os
import threading
from types import SimpleNamespace

import pytest

from overdrive.checkpoint import store
from overdrive.checkpoint.agreed import SaveParts
from overdrive.boundary import run_reporting_errors
from overdrive.errors import UserError
from overdrive.storage import atomic, faults, lock, space


def full(path="") -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path or None)


def test_the_errno_is_found_however_a_library_words_it(tmp_path, monkeypatch):
    assert faults.fault_errno(full()) == errno.ENOSPC
    safetensors = Exception('Error while serializing: IoError(Os { code: 122, kind: FilesystemQuotaExceeded, '
                            'message: "Disk quota exceeded" })')
    assert faults.fault_errno(safetensors) == errno.EDQUOT
    try:
        try:
            raise PermissionError(errno.EACCES, "Permission denied", "/x")
        except OSError as inner:
            raise RuntimeError("saving failed") from inner
    except RuntimeError as wrapped:
        assert faults.fault_errno(wrapped) == errno.EACCES  # found down the chain of causes
    assert faults.fault_errno(ValueError("no")) is None
    assert faults.fault_errno(OSError(errno.ENOENT, "missing")) is None  # not a write fault
    # torch's zip writer gives no errno: the free space left on its file system decides.
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 5782848 vs 5782740")
    monkeypatch.setattr(faults, "free_bytes", lambda path: 4096)
    assert faults.fault_errno(torch_error, tmp_path) == errno.ENOSPC
    monkeypatch.setattr(faults, "free_bytes", lambda path: 10 << 30)
    assert faults.fault_errno(torch_error, tmp_path) == errno.EIO


def test_the_message_names_path_file_system_space_and_key(tmp_path):
    target = tmp_path / "run" / "checkpoints" / ".tmp-step-00000010"
    error = faults.explain(full(), target, "output_dir", what="the checkpoint of step 10", needed=15_000_000,
                           hint="lower checkpoint.keep_last (now 3)")
    text = error.render()
    fs = faults.file_system(tmp_path)
    assert str(target) in text and "no space left" in text and f"mounted at {fs.mount}" in text
    assert "free of" in text and "needs ~15.0 MB" in text
    assert error.problems[0].key == "output_dir" and "checkpoint.keep_last (now 3)" in error.problems[0].fix
    read_only = faults.explain(OSError(errno.EROFS, "Read-only file system"), tmp_path / "tokens", "data.cache_dir")
    assert "read-only" in read_only.render() and "set data.cache_dir" in read_only.problems[0].fix
    denied = faults.explain(PermissionError(errno.EACCES, "Permission denied"), tmp_path / "x", "data.cache_dir")
    assert "write permission" in denied.problems[0].fix
    assert faults.explain(ValueError("not a disk problem"), tmp_path, "output_dir") is None


def test_writing_maps_faults_and_lets_everything_else_through(tmp_path):
    with pytest.raises(UserError) as caught:
        with faults.writing(tmp_path / "metrics.jsonl", "output_dir", what="metrics.jsonl"):
            raise full()
    assert caught.value.problems[0].key == "output_dir"
    with pytest.raises(KeyError):
        with faults.writing(tmp_path, "output_dir"):
            raise KeyError("a bug stays a bug")


def test_a_target_that_cannot_be_written_is_refused_up_front_with_its_file_system(tmp_path, monkeypatch):
    real_mkdir = os.mkdir

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path / "ro")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only)
    with pytest.raises(UserError) as caught:
        faults.writable_target(tmp_path / "ro" / "run", "output_dir", directory=True)
    text = caught.value.render()
    assert "output_dir: cannot write" in text and "the file system is read-only" in text and "file system" in text
    assert "remount it read-write" in text
    with pytest.raises(UserError, match="is a directory, not a file"):  # not a write fault: its own words
        faults.writable_target(tmp_path, "--plot")
    assert faults.writable_target(tmp_path / "fine" / "run", "output_dir", directory=True).is_dir()


def test_the_file_checked_is_the_file_written(tmp_path, monkeypatch):
    """`--plot loss` is written as loss.png by matplotlib, `-o ~/job.sbatch` under $HOME: the
    check and the write name the same file, so a file the user has is never overwritten unasked."""
    (tmp_path / "loss.png").write_text("the user's own plot")
    with pytest.raises(UserError, match="exists and would be overwritten"):
        faults.output_file(tmp_path / "loss", "--plot", False, suffix=".png")
    assert faults.output_file(tmp_path / "loss", "--plot", True, suffix=".png") == tmp_path / "loss.png"
    assert faults.output_file(tmp_path / "a.svg", "--plot", False, suffix=".png") == tmp_path / "a.svg"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert faults.output_file("~/jobs/job.sbatch", "--output", False) == tmp_path / "home" / "jobs" / "job.sbatch"
    assert (tmp_path / "home" / "jobs").is_dir()


@pytest.mark.parametrize("name, said", [
    ("nul", "contains a NUL byte"), ("dangling", "which does not exist"), ("long", "File name too long"),
])
def test_a_target_no_file_can_have_is_refused_by_option(tmp_path, name, said):
    target = {"nul": str(tmp_path / "a\0b"), "dangling": tmp_path / "link", "long": tmp_path / ("x" * 300)}[name]
    (tmp_path / "link").symlink_to(tmp_path / "nowhere" / "file")
    with pytest.raises(UserError, match=said) as caught:
        faults.output_file(target, "--output", False)
    assert caught.value.problems[0].key == "--output"


def test_a_small_file_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
    target = tmp_path / "job.sbatch"
    target.write_text("the user's script\n")
    (tmp_path / "link.sbatch").symlink_to(target)
    faults.write_text(tmp_path / "link.sbatch", "new\n", "--output")  # through the link, the link kept
    assert target.read_text() == "new\n" and (tmp_path / "link.sbatch").is_symlink()

    def disk_full(self, *args, **kwargs):
        raise full()

    monkeypatch.setattr(type(target), "write_text", disk_full)
    with pytest.raises(UserError, match="no space left"):
        faults.write_text(target, "newer\n", "--output")
    monkeypatch.undo()
    assert target.read_text() == "new\n" and sorted(p.name for p in tmp_path.iterdir()) == ["job.sbatch", "link.sbatch"]


def test_a_folder_that_cannot_be_searched_still_gets_its_message(tmp_path, monkeypatch):
    from pathlib import Path

    real_exists = Path.exists

    def unsearchable(self, *args, **kwargs):
        if str(self).startswith(str(tmp_path / "locked" / "")):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_exists(self, *args, **kwargs)

    monkeypatch.setattr(Path, "exists", unsearchable)
    assert faults.nearest_existing(tmp_path / "locked" / "sub" / "file") == tmp_path
    error = faults.explain(PermissionError(errno.EACCES, "Permission denied"), tmp_path / "locked" / "p.png", "--plot")
    assert "write permission" in error.problems[0].fix and "a path you can write" in error.problems[0].fix


def test_the_command_boundary_maps_a_fault_without_a_path_to_the_declared_place(tmp_path, capsys):
    def tracker_flush():
        raise OSError(errno.EIO, "Input/output error")  # a writer's file object: no filename

    with faults.places(output_dir=tmp_path / "run", **{"data.cache_dir": tmp_path / "cache"}):
        code = run_reporting_errors(tracker_flush, command="overdrive train", translate=faults.as_user_error)
    err = capsys.readouterr().err
    assert code == 2 and "output_dir:" in err and "input/output error" in err
    assert "internal error" not in err and "Traceback" not in err

    def cache_write():
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "cache" / "tokens" / "x.ids"))

    with faults.places(output_dir=tmp_path / "run", **{"data.cache_dir": tmp_path / "cache"}):
        code = run_reporting_errors(cache_write, command="overdrive train", translate=faults.as_user_error)
    assert code == 2 and "data.cache_dir:" in capsys.readouterr().err


def test_a_fault_in_a_library_thread_is_held_not_printed(capsys):
    def writer_thread():
        raise OSError(errno.ENOSPC, "No space left on device")

    with faults.thread_faults() as held:
        thread = threading.Thread(target=writer_thread)
        thread.start()
        thread.join()
    assert len(held) == 1 and held[0].errno == errno.ENOSPC
    assert "Traceback" not in capsys.readouterr().err


def test_a_failed_save_removes_its_temp_dir_and_keeps_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    previous = store.begin(root, 5)
    (previous / "model.safetensors").write_bytes(b"w" * 100)
    store.commit(previous, 5)
    tmp = store.begin(root, 10)
    parts = SaveParts(SimpleNamespace(num_processes=1, is_main_process=True, is_local_main_process=True), tmp,
                      "the checkpoint of step 10", 15_000_000, "lower checkpoint.keep_last (now 2)")
    parts.part(lambda: (tmp / "trainer_state.json").write_text("{}"))  # a part that works

    def half_written():
        (tmp / "model.safetensors").write_bytes(b"half")
        raise RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                           '"No space left on device" })')

    with pytest.raises(UserError) as caught:
        parts.part(half_written)
    assert "the checkpoint of step 10" in caught.value.render() and "no space left" in caught.value.render()
    assert not tmp.exists()
    assert [p.name for p in root.iterdir()] == ["step-00000005"] and store.verify(root / "step-00000005").ok


def test_a_truncated_checkpoint_is_set_aside_until_a_newer_one_is_saved(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (5, 10):
        tmp = store.begin(root, step)
        (tmp / "model.safetensors").write_bytes(b"w" * 1000)
        store.commit(tmp, step)
    with open(root / "step-00000010" / "model.safetensors", "r+b") as f:
        f.truncate(10)
    search = store.latest_complete(root, checksums=False, put_aside=True)
    assert search.found.step == 5
    assert search.messages() == ["skipping step-00000010: model.safetensors has 10 bytes, the manifest says 1000; "
                                 "set aside as .corrupt-step-00000010"]
    assert store.candidates(root) == [root / "step-00000005"]
    store.prune(root, keep_last=3, current_step=5)
    assert (root / ".corrupt-step-00000010").exists()  # still the newest step seen: kept for a look
    tmp = store.begin(root, 10)
    (tmp / "model.safetensors").write_bytes(b"w" * 1000)
    store.commit(tmp, 10)
    store.prune(root, keep_last=3, current_step=10)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000005", "step-00000010"]
    assert store.size_of(root / "step-00000010") == 1000  # the files its manifest lists


def test_a_damaged_token_cache_is_set_aside_and_rebuilt(tmp_path, capsys):
    from overdrive.data import cache
    prepare_module = importlib.import_module("overdrive.data.prepare")  # the package exports a function of that name

    entry = tmp_path / "tokens" / "abc"
    entry.mkdir(parents=True)
    (entry / "train.ids").write_bytes(b"\0" * 64)
    (entry / "done.json").write_text(json.dumps({"counts": {}, "dtype": "uint16", "lengths": {"train.ids": 128}}))
    assert cache.damage(entry) == "train.ids has 64 bytes, done.json says 128"
    with pytest.raises(cache.NotReady):  # a process that does not build waits for the one that does
        prepare_module._set_aside_if_damaged(entry, build=False, show=False)
    prepare_module._set_aside_if_damaged(entry, build=True, show=True)
    assert not entry.exists() and (entry.parent / ".corrupt-abc").is_dir()
    assert "abc is damaged (train.ids has 64 bytes, done.json says 128); set aside" in capsys.readouterr().err
    (entry.parent / "xyz").mkdir()
    (entry.parent / "xyz" / "done.json").write_text("{not json")
    assert cache.damage(entry.parent / "xyz") == "done.json is unreadable"


def test_an_atomic_directory_keeps_the_old_copy_when_the_new_one_fails(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("old")
    with pytest.raises(UserError):
        with atomic.directory(target, "output_dir", "the final model") as tmp:
            (tmp / "config.json").write_text("new, half")
            raise full(str(tmp / "model.safetensors"))
    assert (target / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    with atomic.directory(target, "output_dir", "the final model") as tmp:
        (tmp / "config.json").write_text("new")
    assert (target / "config.json").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_a_second_run_into_an_output_dir_is_refused_naming_the_first(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    path = run / lock.LOCK_NAME
    # The first run: another open file description holding the flock, as another process would.
    first = os.open(path, os.O_RDWR | os.O_CREAT)
    fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(first, json.dumps({"pid": 4242, "host": "node7", "started": 1.0e9, "command": "overdrive train"}).encode())
    try:
        with pytest.raises(UserError) as caught:
            lock.hold(run)
        text = caught.value.render()
        assert "output_dir:" in text and "pid 4242 on node7" in text and "overdrive train" in text
    finally:
        os.close(first)  # the first run ends (or is killed): the kernel drops its lock
    held = lock.hold(run)
    try:
        record = json.loads(held.read_text())
        assert record["pid"] == os.getpid()
        assert lock.hold(tmp_path / "run", machine_rank=1).name == f"{lock.LOCK_NAME}.machine1"  # its own
    finally:
        lock.release(held)
        lock.release(run / f"{lock.LOCK_NAME}.machine1")


def test_room_warns_when_the_checkpoints_will_not_fit(tmp_path, monkeypatch):
    assert space.estimated_checkpoint_bytes(1_000_000) == 12_000_000 + space.SMALL_FILES
    monkeypatch.setattr(space, "file_system", lambda path: faults.FileSystem("/data", "xfs", 30_000_000, 10**9))
    room = space.Room(tmp_path, 100_000_000, 20_000_000, keep_last=2, measured=True)
    assert room.warning() is None and not room.tight  # three checkpoints fit
    room = space.Room(tmp_path, 30_000_000, 16_000_000, keep_last=2, measured=True)
    assert room.next_fits and room.tight
    assert "room for 1 more" in room.warning() and "checkpoint.keep_last (now 2)" in room.warning()
    assert "16.0 MB per checkpoint (measured)" in room.summary() and "on /data (xfs)" in room.summary()
