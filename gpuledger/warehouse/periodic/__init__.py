"""The periodic reports, in pieces; gpuledger.warehouse.periodic.commands is their entry point."""
