"""Engine adapters behind one small interface (see base.py)."""
