"""Engine adapters behind one small interface (see base.py); table.py lists
them for the command line."""
