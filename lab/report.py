"""`python -m lab.report` moved to `python -m labtools.report`.

This forwarder, which imports nothing of the lab's, stays for one release.
"""

import runpy
import sys

if __name__ == "__main__":
    print("lab.report moved: python -m labtools.report", file=sys.stderr)
    runpy.run_module("labtools.report", run_name="__main__", alter_sys=True)
