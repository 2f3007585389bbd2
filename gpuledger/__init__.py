"""GPU Ledger: turns GPU-cluster telemetry into an accounting of compute."""

__version__ = "0.1.0"
