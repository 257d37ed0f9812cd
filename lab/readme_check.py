"""`python -m lab.readme_check` moved to `python -m labtools.readme_check`.

This forwarder, which imports nothing of the lab's, stays for one release.
"""

import runpy
import sys

if __name__ == "__main__":
    print("lab.readme_check moved: python -m labtools.readme_check", file=sys.stderr)
    runpy.run_module("labtools.readme_check", run_name="__main__", alter_sys=True)
