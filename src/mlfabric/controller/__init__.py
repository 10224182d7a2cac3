"""The controller: the asyncio service (`controller`), its bookkeeping and
decisions without I/O (`state`), and the `mlfabric controller` and
`mlfabric status` commands (`cli`, `status_cli`). What it decides with is
`mlfabric.scheduling`."""
