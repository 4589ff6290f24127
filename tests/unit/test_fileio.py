"""marlow.fileio: a folder held by one holder at a time."""

from __future__ import annotations

import subprocess
import sys

import pytest

from marlow.fileio import FolderBusy, held


def test_a_held_folder_refuses_a_second_holder_at_once_and_gets_nothing_written(tmp_path):
    with held(tmp_path, "marlow train"):
        busy = f"^another marlow train is running in {tmp_path}$"
        with pytest.raises(FolderBusy, match=busy), held(tmp_path, "marlow train"):
            pass
        assert list(tmp_path.iterdir()) == []
    with held(tmp_path, "marlow train"):  # let go of at the end of the block
        pass


def test_a_process_killed_while_holding_a_folder_lets_go_of_it(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time\nfrom marlow.fileio import held\n"
            f"with held({str(tmp_path)!r}, 'x'):\n    print('held', flush=True)\n    time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FolderBusy), held(tmp_path, "x"):
            pass
    finally:
        holder.kill()
        holder.wait()
    with held(tmp_path, "x"):
        pass
