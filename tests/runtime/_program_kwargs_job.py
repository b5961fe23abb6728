"""The process that runs programs made elsewhere (test_program_kwargs.py runs it in a subprocess):

    python _program_kwargs_job.py DIR NAME...   for each program DIR/NAME, in turn, deserialize it
                                                (made by another process), call it on ones(4, f32)

A program that runs 60 s ends the process (faulthandler prints its stacks). It defines the op the
programs call ('kwargs_reader', as _forging.reader), and prints a JSON line per program: {"case",
"out", "seen"} (the output and the kwargs the callback read) or {"case", "refused"} (the message).
"""

import faulthandler
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _forging
import jax
import jax.export
import jax.numpy as jnp

seen = []
op = _forging.reader(seen)
folder = sys.argv[1]
for name in sys.argv[2:]:
    with open(os.path.join(folder, name), "rb") as file:
        program = jax.export.deserialize(bytearray(file.read()))
    seen.clear()
    faulthandler.dump_traceback_later(60, exit=True)  # a program that hangs ends the process (stacks on stderr)
    try:
        out = program.call(jnp.ones(4, jnp.float32))
        line = {"case": name, "out": [float(v) for v in out], "seen": list(seen)}
    except Exception as err:
        line = {"case": name, "refused": str(err)}
    faulthandler.cancel_dump_traceback_later()
    print(json.dumps(line), flush=True)
