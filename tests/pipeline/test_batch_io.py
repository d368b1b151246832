"""Output files (`run -o`, `results -o`): regular files only, written whole or not at all with the
user's umask; a character device is written through, never replaced; a killed run's `.part`
file is taken over by the next run of the same output, a live run's is left alone."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.batch_io import OutputError, atomic_output, output_problem

ROOT = Path(__file__).resolve().parents[2]


def _write(path: Path, text: str) -> None:
    with atomic_output(path) as f:
        f.write(text)


@pytest.fixture
def umask():
    """Set the process's umask for a test (restored after it)."""
    old = os.umask(0o022)
    os.umask(old)
    yield os.umask
    os.umask(old)


@pytest.mark.parametrize(("mask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664), (0o000, 0o666)])
def test_a_new_output_gets_the_mode_of_the_umask(tmp_path, umask, mask, mode):
    umask(mask)
    out = tmp_path / "out.jsonl"
    _write(out, "x\n")
    assert out.read_text() == "x\n" and stat.S_IMODE(out.stat().st_mode) == mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_a_replaced_output_keeps_its_mode_and_a_symlink_stays_a_link(tmp_path, umask):
    umask(0o022)
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    out.chmod(0o640)
    _write(out, "new\n")
    assert out.read_text() == "new\n" and stat.S_IMODE(out.stat().st_mode) == 0o640
    (tmp_path / "sub").mkdir()
    link = tmp_path / "sub" / "link.jsonl"
    link.symlink_to(out)
    _write(link, "through the link\n")
    assert link.is_symlink() and out.read_text() == "through the link\n"
    assert sorted(p.name for p in (tmp_path / "sub").iterdir()) == ["link.jsonl"]


def test_an_error_leaves_the_old_file_and_no_part_file(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")
    with pytest.raises(RuntimeError), atomic_output(out) as f:
        f.write("half")
        raise RuntimeError("the run failed")
    assert out.read_text() == "previous\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]


def test_a_terminal_is_written_through_not_replaced():
    master, slave = os.openpty()
    try:
        name = os.ttyname(slave)
        assert output_problem(name) is None
        _write(Path(name), '{"id": "a"}\n')
        assert stat.S_ISCHR(os.stat(name).st_mode)  # still the terminal
        assert os.read(master, 4096).replace(b"\r\n", b"\n") == b'{"id": "a"}\n'
    finally:
        os.close(master)
        os.close(slave)


def test_a_character_device_node_is_written_through_not_replaced(tmp_path):
    node = tmp_path / "null"
    try:
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # the null device, as /dev/null is
    except PermissionError:
        pytest.skip("making a device node needs root")
    _write(node, "gone\n")
    assert stat.S_ISCHR(node.stat().st_mode) and os.major(node.stat().st_rdev) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["null"]


def test_directories_and_fifos_are_refused(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for path, why in ((tmp_path, "is a directory"), (fifo, "is a FIFO"),
                      (tmp_path / "no" / "out.jsonl", "does not exist"), (tmp_path / "dangling", "symlink to nothing")):
        assert why in (output_problem(path) or ""), path
        with pytest.raises(OutputError, match=why), atomic_output(path):  # refused before anything is opened
            pytest.fail("entered")
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "fifo"]


# a child process that starts writing `out` (argv[1]), says so on stdout, then does what argv[2] says
_WRITER = textwrap.dedent("""
    import os, signal, sys
    from pipeline.batch_io import atomic_output
    with atomic_output(sys.argv[1]) as f:
        f.write("partial line")
        f.flush()
        print("writing", flush=True)
        if sys.argv[2] == "die":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.stdin.readline()  # until the test lets it finish
        f.write(" done\\n")
""")


def _writer(out: Path, then: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(out), then], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == "writing\n"
    return proc


def test_the_next_run_takes_over_a_killed_runs_part_file(tmp_path, umask):
    umask(0o022)
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")
    proc = _writer(out, "die")
    assert proc.wait(30) == -9
    part = tmp_path / ".out.jsonl.part"
    assert part.read_text() == "partial line" and out.read_text() == "previous\n"  # left behind by the kill
    _write(out, "next run\n")
    assert out.read_text() == "next run\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o644


def test_a_live_runs_part_file_is_left_alone(tmp_path):
    out = tmp_path / "out.jsonl"
    proc = _writer(out, "wait")
    try:
        with pytest.raises(OutputError, match="another run is writing it now"), atomic_output(out):
            pytest.fail("entered")
        assert (tmp_path / ".out.jsonl.part").read_text() == "partial line" and not out.exists()
    finally:
        proc.communicate("\n", timeout=30)
    assert proc.returncode == 0 and out.read_text() == "partial line done\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.jsonl"]
