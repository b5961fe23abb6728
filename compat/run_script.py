"""Run a project's script (an example, a benchmark) with the swap and the counts of the plugins.

    PYTHONPATH=compat python compat/run_script.py <script.py> [its arguments]

The same as ``python <script.py> ...`` but with ``jax_swap`` and ``callback_count`` loaded first
(``JAXBIND_SWAP=0`` keeps stock JAX), and the callback counts printed to stderr at the end.
"""

import runpy
import sys

import callback_count

if __name__ == "__main__":
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    callback_count._current[0] = script
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        for line in callback_count.summary_lines():
            print(line, file=sys.stderr)
