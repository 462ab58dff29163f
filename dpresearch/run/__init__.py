"""Running one training job in this process: the run built from its configuration, the loop
and what hooks into it (evaluation, metrics, checkpoints, stop requests, divergence), the
workers' forward/backward, checkpoint files, the loop's clock and the run directory's writer.

Nothing here places processes (`dpresearch.launch`) or checks a configuration
(`dpresearch.config`); submodules are imported on use, so importing the package costs nothing.
"""
