"""The per-host agent: the daemon and its client (`daemon`), the bandwidth
estimator (`estimator`), the job's own traffic from the kernel's counters
(`job_traffic`), the in-network aggregator it can host (`aggregator`) and the
`mlfabric agent` command (`cli`). Its wire protocol is
`mlfabric.wire.agent_protocol`."""

from .daemon import Agent, AgentClient, AgentConfig

__all__ = ["Agent", "AgentClient", "AgentConfig"]
