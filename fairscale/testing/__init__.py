"""Test and benchmark helpers: model families and single-process reference training (internal)."""
