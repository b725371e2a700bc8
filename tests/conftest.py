import os
import sys

# Tests run on the CPU; keep XLA from grabbing every core for its own pool.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))
