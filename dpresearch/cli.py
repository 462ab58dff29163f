"""The `dpresearch` command: one console script in front of every entry point.

    dpresearch train [OVERRIDES]          # = python -m dpresearch.train   (= dpresearch-train)
    dpresearch study run|status|report STUDY.yaml ...           # = python -m dpresearch.study
    dpresearch analysis ROOTS... [--by KEYS] ...                # = python -m dpresearch.analysis
    dpresearch tune-gamma [OVERRIDES]     # = python -m dpresearch.tune_gamma

Each subcommand hands its arguments, unchanged, to the module's own `main` (`--help` on each
says what it takes). Tab completion of training overrides is Hydra's, through the
`dpresearch-train` script: `eval "$(dpresearch-train -sc install=bash)"`.
"""

from __future__ import annotations

import difflib
import importlib
import sys

from dpresearch import __version__

# subcommand -> (module whose `main()` reads sys.argv, what it does)
COMMANDS = {
    "train": ("dpresearch.train", "train one configuration, or sweep with -m (Hydra overrides)"),
    "study": ("dpresearch.study.__main__", "run a study YAML (cases x lrs x seeds), report it"),
    "analysis": ("dpresearch.analysis.__main__", "run directories -> tables, plots, results.md"),
    "tune-gamma": ("dpresearch.tune_gamma", "tune CHOCO-SGD's consensus step size offline"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        f"usage: dpresearch {{{','.join(COMMANDS)}}} [ARGS...]",
        "",
        f"dpresearch {__version__}: communication-efficient distributed SGD research framework",
        "",
        "commands:",
        *(f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()),
        "",
        "`dpresearch COMMAND --help` shows a command's own options.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Dispatch `dpresearch COMMAND ARGS` to COMMAND's module; exits with its status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if args else 2)
    if args[0] in ("-V", "--version"):
        print(f"dpresearch {__version__}")
        sys.exit(0)
    name = args[0].replace("_", "-")
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, list(COMMANDS), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(
            f"error: dpresearch has no command {args[0]!r}; {hint}"
            f"choose one of: {', '.join(COMMANDS)}",
            file=sys.stderr,
        )
        sys.exit(2)
    module = importlib.import_module(COMMANDS[name][0])
    sys.argv = [f"dpresearch {name}", *args[1:]]
    sys.exit(module.main())


if __name__ == "__main__":
    main()
