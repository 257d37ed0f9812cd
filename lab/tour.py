"""`python -m lab.tour` moved to `python -m labtools.tour`.

This forwarder, which imports nothing of the lab's, stays for one release.
"""

import runpy
import sys

if __name__ == "__main__":
    print("lab.tour moved: python -m labtools.tour", file=sys.stderr)
    runpy.run_module("labtools.tour", run_name="__main__", alter_sys=True)
