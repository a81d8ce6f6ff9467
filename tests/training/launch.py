"""Running `kimi-vl` training commands in child processes, as users do: one process or `torchrun` on a free port,
and several independent commands at once (each child pays some 10 s of imports on a slow 2-core machine, so two
runs that do not depend on each other overlap). A failing child fails the test with its stderr, not a bare
`CalledProcessError`."""

import socket
import subprocess
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(command: list[str], nproc: int = 2) -> list[str]:
    """`command` (argv of a `python -m ...` run) as the argv of a `torch.distributed.run` with `nproc` ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            str(free_port()), *command[1:]]


def start(command: list[str], env: dict) -> subprocess.Popen:
    """`command` (argv) started with its stdout and stderr captured; `finish` waits for it."""
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    """Waits for `proc` (from `start`) and fails with the last 4000 characters of its stderr when it exits non-zero;
    returns its stdout."""
    stdout, stderr = proc.communicate(timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(proc.args)} exited {proc.returncode}:\n{stderr[-4000:]}")
    return stdout


def run(command: list[str], env: dict) -> str:
    """`command` (argv) run to its end (`finish`); returns its stdout."""
    return finish(start(command, env))


def run_together(*commands: list[str], env: dict) -> list[str]:
    """Independent `commands` run at the same time; their stdouts, in order. The first failure fails the test."""
    procs = [start(c, env) for c in commands]
    try:
        return [finish(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def torchrun(command: list[str], env: dict, nproc: int = 2) -> str:
    """`command` (argv of a `python -m ...` run) under `torch.distributed.run` with `nproc` ranks; returns the
    ranks' stdout."""
    return run(torchrun_command(command, nproc), env)
