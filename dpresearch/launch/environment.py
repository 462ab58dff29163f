"""Is this process a torchrun worker, or did it inherit a torchrun environment left over?

torchrun's agent gives each worker RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT and
its own TORCHELASTIC_* variables, and hosts the rendezvous store itself. The five variables
alone may be a deliberate launch (a SLURM script that exports them per task; then rank 0
hosts the store on MASTER_PORT) — or a shell that kept them from an earlier job, where the
run would wait for peers that never come, or fail on a port another process holds with a
27-line `DistNetworkError`. `check_distributed_environment` turns what can be known before
anything starts into one line naming the variables; `describe_init_failure` does the same for
a rendezvous that failed anyway.
"""

from __future__ import annotations

import os
import socket

from dpresearch.errors import ConfigError

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
AGENT_VAR = "TORCHELASTIC_RUN_ID"  # set by torchrun's agent for its workers, never by hand


def from_agent() -> bool:
    """The torch.distributed variables were set by torchrun's agent for this process."""
    return AGENT_VAR in os.environ


def environment_names() -> str:
    """`RANK=0 WORLD_SIZE=2 ...` of the variables present."""
    return " ".join(f"{v}={os.environ[v]}" for v in TORCHRUN_VARS if v in os.environ)


def port_held(port: int) -> bool:
    """Another process listens on TCP `port` of this machine (a store could not bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return True
    return False


def check_distributed_environment(backend: str) -> None:
    """Raise `ConfigError` (one line) for torch.distributed variables this run cannot use:
    left over beside `backend=simulated`, or a MASTER_PORT that rank 0 of a hand-made launch
    (no torchrun agent) could not host its store on."""
    present = [v for v in TORCHRUN_VARS if v in os.environ]
    if len(present) < len(TORCHRUN_VARS) or from_agent():
        return  # not a worker (a partial set is ignored), or torchrun's own worker
    unset = f"unset {' '.join(TORCHRUN_VARS)}"
    if backend == "simulated":
        raise ConfigError(
            f"{environment_names()} are set in this shell (left over from a torchrun or SLURM "
            f"job?) but nothing launched this process as a worker; {unset} to run here"
        )
    if os.environ["RANK"] == "0":
        port = os.environ["MASTER_PORT"]
        if not port.isdigit():
            raise ConfigError(f"MASTER_PORT={port} is not a port number; {unset} or fix it")
        if port_held(int(port)):
            raise ConfigError(
                f"MASTER_PORT={port} is held by another process, so rank 0 cannot host the "
                f"rendezvous ({environment_names()} left over from an earlier job?); {unset}, "
                "or export a free MASTER_PORT"
            )


def describe_init_failure(exc: BaseException, timeout_s: float) -> str:
    """One line for a rendezvous (`init_process_group`) that failed."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    origin = "torchrun" if from_agent() else f"the environment ({environment_names()})"
    return (
        f"rank {os.environ.get('RANK')} could not join the other processes at {where} within "
        f"backend.timeout_s={timeout_s:g} s ({first}); the variables came from {origin}: "
        "check every process was started, or unset them"
    )
