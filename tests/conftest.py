import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network

# The build tools (tools/) are imported by the tests that check them.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
