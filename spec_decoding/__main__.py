"""`python -m spec_decoding [role=verifier|drafter] [spec.gamma=4] [model@target=...]`."""

from lab.commandline import run_module

if __name__ == "__main__":
    run_module(__package__)
