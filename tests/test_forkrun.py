"""tests/forkrun.py: a forked run behaves as a fresh interpreter's would, where a test can tell."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from forkrun import run, start


def _script(tmp_path, body: str):
    path = tmp_path / "script.py"
    path.write_text(body)
    return path


def test_exit_code_argv_cwd_and_separate_streams(tmp_path):
    script = _script(tmp_path, "import os, sys\n"
                               "print('out', sys.argv[1:], os.getcwd(), sys.path[0])\n"
                               "os.write(2, b'err at fd level\\n')\n"
                               "print('err', file=sys.stderr)\n"
                               "sys.exit(2)\n")
    proc = run([sys.executable, str(script), "a", "--b"], cwd=tmp_path.parent)
    assert proc.returncode == 2
    assert proc.stdout == f"out ['a', '--b'] {tmp_path.parent} {tmp_path}\n"
    assert proc.stderr == "err at fd level\nerr\n"


def test_started_runs_overlap_each_with_its_own_code_and_output(tmp_path):
    """Two `-c` runs started together (one job's workers): each waits for the other's file before it ends, so
    started one after the other they would time out; each keeps its exit code, argv, environment and streams."""
    code = ("import os, pathlib, sys, time\n"
            "me = os.environ['WHO']\n"
            "pathlib.Path(me).touch()\n"
            "other = pathlib.Path('b' if me == 'a' else 'a')\n"
            "deadline = time.monotonic() + 30\n"
            "while not other.exists() and time.monotonic() < deadline:\n"
            "    time.sleep(0.01)\n"
            "print(me, other.exists(), sys.argv, repr(sys.path[0]))\n"
            "print(me, file=sys.stderr)\n"
            "sys.exit(3 if me == 'a' else 0)\n")
    runs = [start([sys.executable, "-c", code, who], env={**os.environ, "WHO": who}, cwd=tmp_path) for who in "ab"]
    a, b = (r.wait(timeout=60) for r in runs)
    assert (a.returncode, a.stdout, a.stderr) == (3, "a True ['-c', 'a'] ''\n", "a\n")
    assert (b.returncode, b.stdout, b.stderr) == (0, "b True ['-c', 'b'] ''\n", "b\n")


def test_environment_is_the_childs_and_does_not_leak(tmp_path, monkeypatch):
    monkeypatch.setenv("FORKRUN_PARENT", "1")
    script = _script(tmp_path, "import os\nos.environ['FORKRUN_LEAK'] = '1'\n"
                               "print(os.environ.get('FORKRUN_PARENT'), os.environ.get('FORKRUN_GIVEN'))\n")
    proc = run([sys.executable, str(script)], env={"FORKRUN_GIVEN": "yes", "PATH": os.environ["PATH"]})
    assert (proc.returncode, proc.stdout) == (0, "None yes\n")
    assert "FORKRUN_LEAK" not in os.environ and os.environ["FORKRUN_PARENT"] == "1"


def test_settings_read_at_import_follow_the_childs_environment(tmp_path):
    import huggingface_hub.constants as constants

    before = constants.HF_HUB_OFFLINE
    script = _script(tmp_path, "import huggingface_hub.constants as c\nprint(c.HF_HUB_OFFLINE, c.HF_HOME)\n")
    env = {**os.environ, "HF_HUB_OFFLINE": "0" if before else "1", "HF_HOME": str(tmp_path / "hf")}
    proc = run([sys.executable, str(script)], env=env)
    assert proc.stdout == f"{not before} {tmp_path / 'hf'}\n", proc.stderr
    assert constants.HF_HUB_OFFLINE == before


def test_an_exception_is_a_failed_run_with_its_traceback(tmp_path):
    proc = run([sys.executable, str(_script(tmp_path, "raise ValueError('broken input')\n"))])
    assert proc.returncode == 1 and "ValueError: broken input" in proc.stderr and proc.stdout == ""


def test_module_runs_and_a_hung_child_is_killed_at_the_timeout(tmp_path):
    proc = run([sys.executable, "-m", "json.tool", "--help"])
    assert proc.returncode == 0 and "json.tool" in proc.stdout
    with pytest.raises(subprocess.TimeoutExpired):
        run([sys.executable, str(_script(tmp_path, "import time\ntime.sleep(60)\n"))], timeout=1)


def test_another_live_thread_makes_it_a_real_process(tmp_path):
    """A lock another thread holds at the fork would stay held in the child: then the run starts an interpreter."""
    import threading

    script = _script(tmp_path, "import sys\nprint('pytest' in sys.modules)\n")
    assert run([sys.executable, str(script)]).stdout == "True\n"  # forked: the test process's modules
    stop = threading.Event()
    worker = threading.Thread(target=stop.wait, name="holds-a-lock")
    worker.start()
    try:
        assert run([sys.executable, str(script)]).stdout == "False\n"
    finally:
        stop.set()
        worker.join()
