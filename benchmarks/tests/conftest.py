import sys
from pathlib import Path

# compare.py is a script in benchmarks/, not an installed package
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
