import gc
import sys

from .console import main

code = main()
# Done: exit without the collector's passes over every object torch made at import,
# which took the interpreter's shutdown a second or more (objects are still freed).
gc.freeze()
sys.exit(code)
