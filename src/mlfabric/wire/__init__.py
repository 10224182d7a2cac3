"""What crosses the network, without I/O: the framed protocol between workers,
servers, replicas, aggregators and the controller (`protocol`), the job-token
handshake proofs (`auth`), which bytes of a streamed model may leave early
(`model_stream`), and the agents' probe and control protocol
(`agent_protocol`)."""
