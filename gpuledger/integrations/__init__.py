"""What connects the ledger to tools around it: Superset (superset.py)."""
