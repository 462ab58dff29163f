"""`python -m dpresearch COMMAND ARGS`: the same as the `dpresearch` command (`dpresearch.cli`)."""

from dpresearch.cli import main

if __name__ == "__main__":
    main()
