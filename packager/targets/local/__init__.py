"""The local target: one server process per function on this machine, restored from a CRIU snapshot."""
