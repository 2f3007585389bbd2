"""The periodic reports, in pieces; gpuledger.periodic_reports is their entry point."""
