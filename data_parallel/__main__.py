"""`python -m data_parallel [role=worker dp.nnodes=2 cluster.master.host=ADDR ...] [dp.*=...]`."""

from lab.commandline import run_module

if __name__ == "__main__":
    run_module(__package__)
