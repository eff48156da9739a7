"""Tests import the package from this checkout, installed or not."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
