"""The lab's tools: what no experiment imports at run time.

The host harness (network namespaces, the link-delay forwarder, faults, curves, the documented
runs), the cost model, run_matrix's engine and heatmaps, the report, the tour, the README replay
and the GPU check. Each is an argparse command (`python -m labtools.<tool>`) but run_matrix, which
stays Hydra (`python run_matrix.py`). Tools sit on the top floor: they read the experiment
registry (`lab.registry`) and name no experiment; nothing below them imports them.
"""
