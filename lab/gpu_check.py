"""`python -m lab.gpu_check` moved to `python -m labtools.gpu_check`.

This forwarder, which imports nothing of the lab's, stays for one release.
"""

import runpy
import sys

if __name__ == "__main__":
    print("lab.gpu_check moved: python -m labtools.gpu_check", file=sys.stderr)
    runpy.run_module("labtools.gpu_check", run_name="__main__", alter_sys=True)
