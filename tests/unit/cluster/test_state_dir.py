"""One cluster per state directory; what a crashed one left behind is cleaned up by the next."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import pytest

from l4m.cluster import ClusterConfig, ClusterError, lock_state_dir, prepare_state_dir, remove_stale_sockets


def _abandoned_socket(path: Path) -> None:
    """A Unix socket file nobody listens on, as a killed service leaves it (made without a socket:
    unit tests open none)."""
    os.mknod(path, stat.S_IFSOCK | 0o600)
    assert stat.S_ISSOCK(path.lstat().st_mode)


def test_stale_socket_files_are_removed_and_nothing_else(tmp_path: Path) -> None:
    config = ClusterConfig(state_dir=tmp_path, devices=("cpu",))
    prepare_state_dir(config)
    stale = [config.scheduler_socket, config.socket_dir / "runtime.sock", config.registry_socket,
             config.executor_socket(0)]
    for path in stale:
        _abandoned_socket(path)
    kept = [config.cluster_secret_file, config.socket_dir / "notes.txt"]
    kept[1].write_text("not a socket")
    fd = lock_state_dir(config)
    try:
        assert sorted(remove_stale_sockets(config)) == sorted(stale)
    finally:
        os.close(fd)
    assert not any(path.exists() for path in stale)
    assert all(path.exists() for path in kept)


def test_a_second_cluster_on_one_state_dir_is_refused_while_any_process_of_the_first_lives(tmp_path: Path) -> None:
    config = ClusterConfig(state_dir=tmp_path, devices=("cpu",))
    fd = lock_state_dir(config)
    # A service inherits the claim (as `Cluster._spawn` passes it); the supervisor then dies.
    service = subprocess.Popen(["sleep", "60"], pass_fds=(fd,), start_new_session=True)
    os.close(fd)
    try:
        with pytest.raises(ClusterError, match=f"the state directory {tmp_path} is in use by another l4m cluster"):
            lock_state_dir(config)
    finally:
        service.kill()
        service.wait(timeout=10)
    os.close(lock_state_dir(config))  # the last process of the first cluster is gone: the directory is free
