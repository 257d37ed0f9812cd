"""`python -m fed_learn [role=coordinator|client] [fed.strategy=ffa] [fed.rounds=5]`."""

from lab.commandline import run_module

if __name__ == "__main__":
    run_module(__package__)
