"""Running `kimi-vl` training commands in child processes, as users do: one process or `torchrun` on a free port.
A failing child fails the test with its stderr, not a bare `CalledProcessError`."""

import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(command: list[str], env: dict) -> str:
    """Runs `command` (argv) and fails with the last 4000 characters of its stderr when it exits non-zero; returns
    its stdout."""
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return done.stdout


def torchrun(command: list[str], env: dict, nproc: int = 2) -> str:
    """`command` (argv of a `python -m ...` run) under `torch.distributed.run` with `nproc` ranks; returns the
    ranks' stdout."""
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
                str(free_port()), *command[1:]], env)
