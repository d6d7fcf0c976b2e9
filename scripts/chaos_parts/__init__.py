"""The chaos run (scripts/chaos.py): its world, clients, faults and figures."""
