"""`python -m tensor_parallel [role=rank tp.ranks=2 tp.rank=R cluster.master.host=ADDR ...]`."""

from lab.commandline import run_module

if __name__ == "__main__":
    run_module(__package__)
