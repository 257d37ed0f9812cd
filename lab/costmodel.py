"""`python -m lab.costmodel` moved to `python -m labtools.costmodel`.

This forwarder, which imports nothing of the lab's, stays for one release.
"""

import runpy
import sys

if __name__ == "__main__":
    print("lab.costmodel moved: python -m labtools.costmodel", file=sys.stderr)
    runpy.run_module("labtools.costmodel", run_name="__main__", alter_sys=True)
