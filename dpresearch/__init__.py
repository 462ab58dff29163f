"""dpresearch: communication-efficient distributed SGD research framework.

Importing the package loads nothing heavy (no torch): it only names the version and where the
shipped Hydra configuration lives (`CONF_DIR`, package data, so a wheel install finds it).
"""

from pathlib import Path

__version__ = "0.2.0"

CONF_DIR = Path(__file__).resolve().parent / "conf"
