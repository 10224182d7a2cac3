"""Tooling around the library, not imported by it: the emulated cluster of
network namespaces (`testbed`, `testbed_cli`, `traffic`), the workload and
chaos harnesses (`workload`, `chaos`), the contention benchmark
(`contention`), the demo (`demo`, `demo_model`) and the reference-page
generator (`docgen`)."""
