"""`holdback gateway --workers N`: the multi-process data plane. One flow-control process (flow_process.py) makes
every decision; N relay processes (relay.py) run the proxy with a client of it (remote_flow.py) over a local
channel (channel.py)."""
