"""What crosses the network, without I/O: the framed protocol between workers,
servers, replicas, aggregators and the controller (`protocol`: events, a
table-driven codec, the connection state machine), the handshake both sides
run first (`handshake`) with its job-token proofs (`auth`), what each role
takes (`roles`), data blocks sent as their bytes become final (`streamed`),
and the agents' probe and control protocol (`agent_protocol`)."""
