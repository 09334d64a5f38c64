"""Disk checkpoints of decode states, keyed by rendered-text prefix (lands with the
disk-checkpoint issue)."""
