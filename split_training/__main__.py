"""`python -m split_training [role=driver|stage split.rank=K] [split.microbatches=4]`."""

from lab.commandline import run_module

if __name__ == "__main__":
    run_module(__package__)
