"""Imported by the fork server at its start (first of `forkserver.PRELOAD`): the server dies
with the launcher that started it (`dpresearch.run.lifeline`), at once and whatever killed
the launcher. Its workers are bound to the launcher themselves; the server must not linger
either (it held their output pipes and, before, their lives: an orphaned server took ~6 s
under load to notice its "alive" pipe and exit).

The rule holds wherever this module is imported: a process whose parent is the launcher named
in its environment binds to it; any other process is left alone."""

from __future__ import annotations

import os

from dpresearch.run.lifeline import LAUNCHER_ENV, bind_to_launcher

if os.environ.get(LAUNCHER_ENV, "").partition(":")[0] == str(os.getppid()):
    bind_to_launcher(kernel=False)  # (the kernel's signal follows the thread that started us)
