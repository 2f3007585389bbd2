"""The embedded default, all on one machine: a Tansu broker (broker.py), the worker as a child
process (processes.py), the whole pipeline over any source of messages (pipeline.py), the demo
(demo.py) and publishing simulations or recorded dumps (replay.py)."""
