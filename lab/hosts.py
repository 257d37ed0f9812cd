"""`python -m lab.hosts` moved to `python -m labtools.hosts`.

This forwarder, which imports nothing of the lab's, stays for one release.
"""

import runpy
import sys

if __name__ == "__main__":
    print("lab.hosts moved: python -m labtools.hosts", file=sys.stderr)
    runpy.run_module("labtools.hosts", run_name="__main__", alter_sys=True)
