"""Test support: the scripted model server (also used by bench/)."""
