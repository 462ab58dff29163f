"""dpresearch: communication-efficient distributed SGD research framework.

Importing the package loads nothing heavy (no torch): it only names the version, where the
shipped Hydra configuration lives (`CONF_DIR`, package data, so a wheel install finds it) and,
when the package is imported from a source checkout rather than an installed wheel, that
checkout (`SOURCE_ROOT`).
"""

from pathlib import Path

__version__ = "0.2.0"

CONF_DIR = Path(__file__).resolve().parent / "conf"


def _source_root() -> Path | None:
    """The checkout holding this package (its `pyproject.toml` names dpresearch), or None for
    an installed copy (site-packages holds no pyproject.toml of ours)."""
    root = CONF_DIR.parents[1]
    try:
        return root if 'name = "dpresearch"' in (root / "pyproject.toml").read_text() else None
    except OSError:
        return None


SOURCE_ROOT: Path | None = _source_root()
