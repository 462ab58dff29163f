"""The configuration: the structured schema, the checks that run before any worker starts and
before a run directory exists (each config node owns its own), the pre-flight build of every
component, the command line read before Hydra, and sweeps that check every point.

Submodules are imported on use, so importing the package costs nothing.
"""
