"""Starting a run: placing workers on processes (in this process, K local processes under
torch's elastic agent with a heartbeat watchdog, or one torchrun worker), claiming its run
directory, recording what produced it, and teeing its console output into `train.log`.

Submodules are imported on use, so importing the package costs nothing.
"""
