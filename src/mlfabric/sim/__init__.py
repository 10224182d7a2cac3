"""The flow-level simulator: the policies of the real controller on a modelled
network (`engine`), with max-min fair flow rates (`flownet`).
`python -m mlfabric.sim --help`."""
