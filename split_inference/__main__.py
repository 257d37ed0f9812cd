"""`python -m split_inference [role=driver|stage split.rank=K] [split.num_stages=3] [model=...]`."""

from lab.commandline import run_module

if __name__ == "__main__":
    run_module(__package__)
